"""Replaying a compiled graph as one CUDA graph (`Options.cudagraphs`).

A compiled graph launches each kernel and library call from Python, tens of
microseconds apiece; when the kernels are short the GPU waits on Python. A CUDA
graph records every launch once and replays them with one call.

The runner keeps results exactly as without it:
- only graphs whose arguments are all CUDA tensors, with no input mutation and
  no random op outside the default generator (`eligible`, decided at compile
  time; a replay draws fresh numbers, see RANDOM): inference graphs under
  `auto` and `on`, the forward and backward graphs of training under `on`
  (mode="reduce-overhead");
- one entry per combination of argument sizes, strides and dtypes, recorded at
  the second call (the first compiles the kernels), at most `MAX_GRAPHS`;
- a graph reads each argument either where the caller's tensor is (parameters,
  results of another recorded graph such as the activations a forward graph saved
  for its backward, and the very tensor the previous call passed, e.g. an input
  buffer refilled in place), replayed only while those are at the recorded
  addresses, or from a buffer of its own into which each call copies it;
- results are new tensors over the graph's own output memory, not copies: a
  graph is replayed only while no tensor over its previous results' memory is
  alive (their storages' use counts, `_Slot.free`). A loop `y = f(x)` still
  holds the last result while the next call runs, so an inference entry records
  up to `SLOTS` graphs and alternates between them; when every one is busy, the
  call runs the plain wrapper. Training graphs record one graph per entry and
  share one memory pool between forward and backward (`Pool`). A training forward
  graph hands out its results over its memory too, user-visible ones (the loss,
  logits) included, so that a graph compiled from the next piece of the program
  (a loss after a graph break) reads them where they are. A user-visible result
  found still held when its graph, or a graph recorded after it while it was dead
  (which may have put temporaries in its memory), is about to replay is handed out
  as a copy from then on (`_Slot.copies`); that call records the graph again (at
  most RERECORDS times) or, while something else holds it up, runs plainly;
- in a pool, memory freed in a recording is reused as eager reuses it: the
  recording call hands out the allocator's own tensors and the slot keeps the
  results no caller sees (saved activations, gradients) over storages that own
  no memory (`_Slot.owners`), so the backward's recording, which frees each
  activation at its last use (the caller's argument list is dropped first),
  places its gradients in that memory; its replay then runs while the only
  holders of those activations are its own arguments (`_Slot.unexposed`). No
  recording runs while a result whose memory the allocator counts as free is
  held (it could be placed there); the graphs holding such results record again
  when next free (`Pool.refresh`). Without this the pool held every saved
  activation and every gradient at once (1.2-1.6x Inductor's memory);
- a recording's warm-up runs on a side stream (one a device), whose cached memory
  nothing else uses: released after each recording, with cuBLAS's cached workspaces
  (the recorded graph keeps the one its recording made). A failed recording hands out
  the warm-up's results (its arguments may be freed by then) and replay is off from
  then on;
- under `auto`, only graphs of at least AUTO_MIN_LAUNCHES kernel launches and
  ATen calls (AUTO_MIN_LAUNCHES_NO_MATMUL without matrix products) are replayed;
  any capture error means the plain wrapper from then on.
"""

from __future__ import annotations

import contextlib

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

MAX_GRAPHS = 8
# Times a runner may retire a free graph to record it again on arguments it does
# not read in place (see CudaGraphRunner._make_room)
RERECORDS = 4
# Graphs recorded per entry (see the module docstring): two serve a loop `y = f(x)`.
SLOTS = 2
# Under `auto`, graphs with fewer launches run plainly. Measured on an H200: the
# fp16 GPT-2 block (about 30 launches) ran 0.64 ms replayed against 0.72 ms, while
# one-kernel graphs (a 8192x4096 layer_norm) ran 0.125 ms replayed against 0.072:
# the input copy and output clone cost more than one launch. (Choosing by timing
# both at capture proved unreliable: it picked replay for those.) Since replays
# copy nothing in a steady loop, such graphs time the same either way (H100,
# do_bench: layer_norm_4k 0.102 ms plainly, 0.103 replayed; softmax_1k 0.0945 and
# 0.0942), so replaying them would only hold a second copy of their memory.
AUTO_MIN_LAUNCHES = 12
# Graphs without matrix products wait on Python from 3 launches: conv+bn+relu (a
# copy kernel, the conv, the epilogue) ran 0.101 ms replayed against 0.112, the
# ResNet block (5 launches) 0.167 against 0.217 (H200). With products the GPU is
# busy long enough: the fp16 MLP (cuBLAS, gelu, cuBLAS) lost, 0.257 against 0.241.
# Without the copies (H100): conv+bn+relu 0.084 ms replayed against 0.104 plainly
# (Inductor 0.088-0.157), the ResNet block 0.160 against 0.190 (Inductor 0.202-0.206).
AUTO_MIN_LAUNCHES_NO_MATMUL = 3
MATMUL_OPS = ("mm", "addmm", "bmm")


def auto_declines(aten_ops: dict[str, int], kernels: list[dict[str, Any]]) -> str | None:
    """Under `auto`: why a graph of these ATen calls and kernels (their report
    records, runtime/prepare.py; `matrix_products` is their kind's,
    kinds/kind.py) is not replayed."""
    launches = sum(aten_ops.values()) + len(kernels)
    products = any(aten_ops.get(op) for op in MATMUL_OPS) or any(
        k["matrix_products"] for k in kernels)
    least = AUTO_MIN_LAUNCHES if products else AUTO_MIN_LAUNCHES_NO_MATMUL
    if launches < least:
        kind = "with" if products else "without"
        return f"{launches} launch(es) {kind} matrix products, fewer than {least} (auto)"
    return None


# FX targets that make a graph ineligible: results would land in the graph's
# buffers instead of the caller's tensors.
WRITES = ("copy_", "set_", "resize_")
# Random ops. A CUDA graph replays them with fresh numbers: recording registers the
# default CUDA generator with the graph, and each replay reads the generator's seed
# and advances its offset by what the graph draws, as the ops would run one by one
# (so `torch.manual_seed` between steps still decides the numbers). Dropout in
# training is replayed so (`eligible`); an op that draws from a generator of its own
# (a `generator=` argument), or writes its result in place, is not.
RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "exponential", "multinomial")
# What a loaded package refuses to replay (runtime/package.py): its programs carry
# op names only.
UNSAFE = WRITES + RANDOM


def _refused_random(node: torch.fx.Node, name: str) -> bool:
    """A random op a replay cannot draw afresh (see RANDOM): one with a generator of
    its own, one without a schema to tell, and randperm."""
    return any(r in name for r in RANDOM) and (
        "randperm" in name or getattr(node.target, "_schema", None) is None
        or node.kwargs.get("generator") is not None)


def eligible(gm: torch.fx.GraphModule, kind: str, aliased_outputs: bool,
             training: bool = False) -> str | None:
    """None when the graph may be replayed; else why not. Training graphs (forward
    and backward) only with `training` (cudagraphs="on": mode="reduce-overhead").
    A training graph may write into its own inputs (`mutated_inputs`: BatchNorm's
    running statistics), which a replay does where they are; random ops replay with
    fresh numbers (RANDOM)."""
    if kind not in ("inference", "forward", "backward") or (
            kind != "inference" and not training):
        return f"a {kind} graph (only inference graphs are replayed under cudagraphs=auto)"
    if aliased_outputs:
        return "an output aliases an input"
    writes = set(mutated_inputs(gm)) if kind != "inference" else set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node not in writes:
            name = getattr(node.target, "__name__", str(node.target))
            schema = getattr(node.target, "_schema", None)
            if (any(w in name for w in WRITES) or _refused_random(node, name)
                    or (schema is not None and schema.is_mutable)):
                return f"it calls {name}"
    return None


def mutated_inputs(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """The graph's `copy_(input, value)` nodes (AOTAutograd keeps the updates of
    buffers that need no gradient so) and the input position each writes."""
    places = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return {n: places[n.args[0]] for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
            and n.args and n.args[0] in places}


def fixed_layouts(gm: torch.fx.GraphModule) -> bool:
    """Does every argument of the graph have one size and one stride, whatever the
    call (no symbolic size among its placeholders)? TorchDynamo's guards then compile
    the graph again for another layout, and the runner's entry key is one for all
    calls (`CudaGraphRunner._key`)."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            if not all(isinstance(d, int) for d in (*val.shape, *val.stride())):
                return False
        elif not isinstance(val, int | float | bool):
            return False  # a SymInt, or not known
    return True


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# Storages of every recorded graph's outputs: a later graph reads such an argument
# where it is (a backward graph reads the activations its forward graph saved), as
# it reads parameters. Only a hint: every replay still checks the addresses.
_GRAPH_OUTPUTS: set[int] = set()
# Storages of the parameters recorded graphs read in place: a backward graph reads
# those the forward saved for it (layer and batch norm weights) in place too, instead
# of copying each into a buffer at every replay (55 copies a ResNet-50 step). A hint
# as well, checked by every replay.
_GRAPH_PARAMS: set[int] = set()


class Pool:
    """The memory pool the CUDA graphs of one compiled TorchDynamo graph share (its
    forward and backward graphs): a graph recorded later reuses what an earlier one
    freed, so training holds about what eager holds at its peak, not the sum of
    every graph's peak. The price is an order: a graph recorded earlier may write,
    in the memory it used for temporaries, over the results of one recorded later,
    so it replays only while those results are dead (`Pool.clear_after`)."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.slots: list[_Slot] = []
        # a recording waits for results the allocator counts as free (`_Slot.owners`)
        # to be its own again: their graphs record again when next free
        self.refresh = False

    def forget(self, slots: Sequence[_Slot]) -> None:
        """Drop `slots` (retired)."""
        gone = {id(s) for s in slots}
        self.slots = [s for s in self.slots if id(s) not in gone]
        if not self.slots:
            # no graph of the pool is left: the allocator forgets a pool id once
            # its last graph goes, and a recording into it fails (an internal
            # assert), so the next recording starts a pool of its own
            self.handle = None
            self.refresh = False

    def after(self, slot: _Slot) -> list[_Slot]:
        """The slots recorded after `slot` in this pool."""
        at = next((i for i, s in enumerate(self.slots) if s is slot), len(self.slots))
        return self.slots[at + 1:]

    def clear_after(self, slot: _Slot) -> bool:
        """No slot recorded after `slot` in this pool holds results still alive."""
        return all(other.free() for other in self.after(slot))

    def dead(self) -> list[tuple[_Slot, list[int]]]:
        """The results of this pool's slots that nothing outside holds now, per slot
        (indices into its `tensors`): memory a graph recorded now may reuse."""
        out = []
        for slot in self.slots:
            dead = slot.dead()
            if dead:
                out.append((slot, dead))
        return out


@dataclass
class _Slot:
    """One recorded graph of an entry."""

    replay: Callable[[], Any]
    reads: tuple[int, ...]  # the address of each argument the graph reads
    # per argument, the buffer each call copies it into, or None for an argument read
    # where it is (a parameter, another graph's result, a buffer refilled in place):
    # replayed only while such arguments are at `reads`
    buffers: list[torch.Tensor | None]
    outputs: Sequence[Any]  # the graph's results (tensors over its own memory)
    tensors: list[torch.Tensor]  # those results whose memory is the graph's
    addresses: list[int]  # each tensor's address when recorded
    # each result's storage use count when recorded, before any result was handed out.
    # Exactly equal, not at most: a reference of the recording's that went away since
    # could otherwise hide one of the caller's (the graph then runs plainly, never
    # over a result still held)
    uses: list[int]
    # result positions handed out as copies: results over an input buffer the next
    # call refills, and user-visible results of a forward graph once one was found
    # held past its step (`CudaGraphRunner._copy_held`)
    copies: set[int] = field(default_factory=set)
    static: tuple[int, ...] = ()  # the arguments read where they are
    # each tensor's storage, held (counted in `uses`), and its handle: the replay's
    # check then makes no storage object per result (588 results a ResNet-50 forward)
    storages: list[Any] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # each tensor's result position
    user: frozenset[int] = frozenset()  # positions the caller sees (a forward's outputs)
    # results of slots recorded before this one in its pool that were dead when it
    # was recorded (indices into their `tensors`): this graph may write over them,
    # so it replays only while they are dead
    exposed: list[tuple[_Slot, list[int]]] = field(default_factory=list)
    # the runner's positions found held once: every slot it records copies them
    held_once: set[int] = field(default_factory=set)
    # per entry of `exposed`, per index, the positions of this graph's arguments that
    # view that result (the activations a backward reads and frees): references a
    # replay's own arguments hold, which `unexposed` does not count as a holder
    exposed_args: list[list[tuple[int, ...]]] = field(default_factory=list)
    # In a pool, the slot keeps its results over storages that own no memory
    # (`CudaGraphRunner._disown`): what the recording call handed out is the
    # allocator's, and once the caller drops it the pool's next recording (the
    # backward) may reuse that memory, as eager reuses a freed activation's. Per
    # index into `tensors`, a weak reference to the storage the recording call
    # handed out, while it may live; None after.
    owners: list[Any] = field(default_factory=list)
    disowned: tuple[int, ...] = ()  # indices of the `tensors` that own no memory
    produced: tuple[int, ...] = ()  # the arguments read in place that graphs made
    # results that view an argument read in place (a loss graph saving the logits it
    # reads): per position, the argument, the view's size and stride, and its storage
    # offset less the argument's. The slot keeps no tensor of theirs, whose hold on
    # the argument's storage would make the graph that produced it look held by its
    # caller for good.
    aliases: dict[int, tuple[int, Any, Any, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._checked = (list(self.reads), list(self.static))  # as _SAME_ADDRESSES takes them
        # the arguments copied into `buffers` at each replay
        self.copied = tuple(i for i, b in enumerate(self.buffers) if b is not None)
        # every result a tensor: results() then detaches them in one map
        self.all_tensors = all(isinstance(o, torch.Tensor) for o in self.outputs)
        # per exposed entry, what `unexposed` compares in one pass each: the results'
        # storages, their use counts when dead but for a replay's own arguments, their
        # tensors and addresses
        self._expected = [
            ([slot.handles[j] for j in dead],
             [slot.uses[j] + len(p) for j, p in zip(dead, places, strict=True)],
             [slot.tensors[j] for j in dead], [slot.addresses[j] for j in dead])
            for (slot, dead), places in zip(self.exposed, self.exposed_args, strict=True)]

    def owned(self) -> list[int]:
        """Indices of the results whose recording-call tensors are still alive."""
        if not self.owners:
            return []
        alive = [j for j, w in enumerate(self.owners) if w is not None and not w.expired()]
        if not alive:
            self.owners = []  # none comes back: later checks skip this
        return alive

    def free(self) -> bool:
        """No tensor over the previous results' memory is alive (and no result's
        storage was resized away from the graph's memory)."""
        return (list(map(torch._C._storage_Use_Count, self.handles)) == self.uses
                and list(map(torch.Tensor.data_ptr, self.tensors)) == self.addresses
                and not self.owned())

    def dead(self) -> list[int]:
        """Indices of the results (into `tensors`) that nothing outside holds."""
        count = torch._C._storage_Use_Count
        owned = set(self.owned())
        return [j for j, (h, u) in enumerate(zip(self.handles, self.uses, strict=True))
                if count(h) == u and j not in owned]

    def held(self, indices: Sequence[int], args: Sequence[Any] = (),
             places: Sequence[tuple[int, ...]] = ()) -> list[int]:
        """Those of `indices` (into `tensors`) whose memory something outside holds;
        with `places` (per index, positions into `args`), references from those
        arguments, which the call that passes them consumes, are not holders."""
        count = torch._C._storage_Use_Count
        owned = self.owned()
        out = []
        for k, j in enumerate(indices):
            uses = self.uses[j]
            if places and places[k]:
                uses += len({id(args[i]) for i in places[k]})
            if count(self.handles[j]) != uses or j in owned \
                    or self.tensors[j].data_ptr() != self.addresses[j]:
                out.append(j)
        return out

    def disowned_held(self) -> bool:
        """Does anything hold a result whose memory the allocator counts as free
        (`owners`: handed out by a replay)? A recording into the pool then may not
        run: it could place its own tensors there."""
        if not self.disowned:
            return False
        owned = set(self.owned())
        return bool(self.held([j for j in self.disowned if j not in owned]))

    def unexposed(self, args: Sequence[Any]) -> bool:
        """Are the earlier slots' results this graph may write over still dead (or
        held only by `args`, the arguments of the call about to replay it, which it
        reads before it writes over them)?"""
        count = torch._C._storage_Use_Count
        for (slot, dead), places, (handles, uses, tensors, addresses) in zip(
                self.exposed, self.exposed_args, self._expected, strict=True):
            # the common case in one pass; `held` then counts an argument passed
            # twice, which holds one reference, once
            if list(map(count, handles)) == uses and not slot.owned() \
                    and list(map(torch.Tensor.data_ptr, tensors)) == addresses:
                continue
            if slot.held(dead, args, places):
                return False
        return True

    def takes(self, args: Sequence[torch.Tensor]) -> bool:
        """Are the arguments read in place where the graph reads them?"""
        if _SAME_ADDRESSES is not None:  # one C++ call (CUDA builds of torch)
            return _SAME_ADDRESSES(args, *self._checked)
        reads = self.reads
        return all(args[i].data_ptr() == reads[i] for i in self.static)

    def fill(self, args: Sequence[torch.Tensor]) -> None:
        """Copy the arguments not read in place into the graph's buffers, in one call."""
        dsts, srcs = [], []
        for i in self.copied:
            buf, a = self.buffers[i], args[i]
            if buf is not None and buf.data_ptr() != a.data_ptr():
                dsts.append(buf)
                srcs.append(a)
        if len(dsts) > 1:
            torch._foreach_copy_(dsts, srcs)
        elif dsts:
            dsts[0].copy_(srcs[0])

    def results(self, args: Sequence[torch.Tensor]) -> Any:
        """New tensors over the results' memory (copies where `copies` says) and over
        the arguments the `aliases` view, in the wrapper's container type."""
        kind: Any = type(self.outputs)  # a list or a tuple
        if not self.copies and not self.aliases and self.all_tensors:
            return kind(map(torch.Tensor.detach, self.outputs))
        out = _handed_out(self.outputs, self.copies)
        for i, (a, size, stride, rel) in self.aliases.items():
            arg = args[a]
            out[i] = arg.detach().as_strided(size, stride, arg.storage_offset() + rel)
        return kind(out)


@dataclass
class _Entry:
    params: list[torch.Tensor]  # parameter arguments, read in place
    versions: list[int]  # their version counters when the first graph was recorded
    slots: list[_Slot]


# The entry key of a runner whose graph has fixed layouts
_ONE_LAYOUT: tuple[Any, ...] = ()
# Drops cuBLAS's cached workspaces (every stream's); CUDA builds only
_CLEAR_CUBLAS_WORKSPACES = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
# Compares the data pointers of tensors at given positions with expected ones, in
# C++ (what Inductor's CUDA-graph trees check static inputs with); CUDA builds only.
_SAME_ADDRESSES = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def _addresses(args: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(a.data_ptr() for a in args)


def _seen(args: Sequence[torch.Tensor]) -> tuple[tuple[Any, int], ...]:
    """Each argument (weakly) and its address, as a plain call passed them."""
    return tuple((weakref.ref(a), a.data_ptr()) for a in args)


class CudaGraphRunner:
    """A boxed callable (takes a list of arguments) around the plain wrapper `fn`.

    `kind` is the graph's (inference, forward or backward). Training graphs record
    one graph per entry (`slots`) and share `pool` between forward and backward. A
    forward graph's first `user_outputs` results are the caller's; the rest are the
    activations saved for the backward, which die in it. The caller's are handed out
    over the graph's memory until one is found held past its step (a loss kept in a
    list), and as copies from then on (`_copy_held`)."""

    def __init__(self, fn: Callable[[list[Any]], Any], params: Sequence[bool], mode: str,
                 log: Callable[[str], None] | None = None, *, kind: str = "inference",
                 user_outputs: int | None = None, pool: Pool | None = None,
                 mutated: Sequence[int] = (), applied: Sequence[int] = (),
                 fixed: bool = False) -> None:
        self.fn = fn
        # every call's arguments have the graph's one layout (`fixed_layouts`): the
        # entry key is one, not each argument's (a backward graph reads hundreds of
        # saved activations: T5-small's 435, 0.5-1 ms of host time a step)
        self.fixed = fixed
        self.mutated = frozenset(mutated)  # inputs the graph writes into
        # results among the first `user_outputs` that are new values of the caller's
        # inputs, which AOTAutograd copies into them as soon as the graph returns
        # (BatchNorm's running statistics): handed out without a copy of their own
        self.applied = frozenset(applied)
        self.params = list(params)
        self.mode = mode  # "auto" or "on"
        self.log = log or (lambda line: None)
        self.kind = kind
        self.user_outputs = user_outputs
        self.pool = pool
        self.slots = SLOTS if kind == "inference" else 1
        # per key, the arguments (weakly) and addresses of the last plain call
        self.seen: dict[Any, tuple[tuple[Any, int], ...]] = {}
        self.held_once: set[int] = set()  # user results found held past their step
        self.recorded = "CUDA graph"  # the last recording's log line
        self.graphs: dict[Any, _Entry] = {}
        self.disabled: str | None = None
        self.plain = 0  # calls that found every slot busy (tests read it)
        self.rerecords = 0
        self.replays = 0
        self.keyed: list[int] | None = None  # the arguments `_key` reads
        self.arity = 0
        self._boxed_call = True

    # A pooled slot keeps its results over storages that own no memory (`_Slot.owners`)
    DISOWN = True

    @staticmethod
    def _accepts(args: list[Any]) -> bool:
        return all(isinstance(a, torch.Tensor) and a.is_cuda for a in args)

    def _is_param(self, i: int) -> bool:
        return i < len(self.params) and self.params[i]

    def _key(self, args: list[torch.Tensor]) -> tuple[Any, ...]:
        """What tells the graphs of an entry apart: the shape, strides, dtype and
        device of each argument that is not a parameter. A parameter's are
        TorchDynamo's guards' to watch (a change compiles the graph again), and a
        forward graph's arguments are mostly parameters (ResNet-50: 320 of 321)."""
        if self.fixed:
            return _ONE_LAYOUT
        keyed = self.keyed
        if keyed is None or len(args) != self.arity:
            keyed = self.keyed = [i for i in range(len(args)) if not self._is_param(i)]
            self.arity = len(args)
        return tuple([(a.shape, a.stride(), a.dtype, a.device)
                      for a in [args[i] for i in keyed]])

    def __call__(self, args: list[Any]) -> Any:
        if self.disabled is not None or not args:
            return self.fn(args)
        if not self._accepts(args):
            return self.fn(args)
        key = self._key(args)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen or len(self.graphs) >= MAX_GRAPHS:
                return self._run_plainly(key, args)
            # Training graphs fold nothing, and the optimizer updates the parameters in
            # place every step: only an inference graph's parameters are watched.
            params = [a for i, a in enumerate(args) if self._is_param(i)
                      and self.kind == "inference"]
            entry = self.graphs[key] = _Entry(params, [p._version for p in params], [])
        elif any(a._version != v for a, v in zip(entry.params, entry.versions, strict=True)):
            # a parameter changed in place: constants folded from it (aten/fold.py)
            # may be stale inside the graphs, so record them again
            self._retire(entry.slots)
            del self.graphs[key]
            return self._run_plainly(key, args)
        slot = self._pick(entry, args)
        if slot is not None and slot.disowned and self.pool is not None and self.pool.refresh \
                and self.rerecords < RERECORDS:
            # Another graph of the pool waits to record (a backward first seen after
            # this forward was recorded) while this graph's results, which it reads,
            # are memory the allocator counts as free: recorded again now, this
            # graph hands out the allocator's tensors, and that recording can follow.
            self._record_again(entry, slot)
            slot = None
        if slot is None:
            if len(entry.slots) >= self.slots and not self._copy_held(entry, args) \
                    and not self._make_room(entry, args):
                self._copy_later_held(entry, args)
                self.plain += 1
                return self._run_plainly(key, args)
            if self.pool is not None and any(s.disowned_held() for s in self.pool.slots):
                # a recording could place its tensors over a result still held
                self.pool.refresh = True
                self.plain += 1
                return self._run_plainly(key, args)
            return self._capture(entry, args, self.seen.get(key))
        slot.fill(args)
        slot.replay()
        self.replays += 1
        out = slot.results(args)
        args.clear()  # as the plain wrapper does: the caller's references are its own
        return out

    def _make_room(self, entry: _Entry, args: list[torch.Tensor]) -> bool:
        """Every slot is taken. One that is free but reads in place a tensor the
        caller no longer passes (an input the allocator happened to place at the same
        address twice) is retired, up to RERECORDS times, so that it is recorded again."""
        if self.rerecords >= RERECORDS:
            return False
        for slot in entry.slots:
            # (not when an argument the slot reads from another graph's results comes
            # from a plain run of that graph: a recording now would copy that graph's
            # results into buffers at every replay from then on)
            if slot.free() and not slot.takes(args) and not any(
                    args[i].data_ptr() != slot.reads[i] and _storage(args[i]) not in
                    _GRAPH_OUTPUTS for i in slot.produced):
                self._record_again(entry, slot)
                return True
        return False

    def _run_plainly(self, key: Any, args: list[Any]) -> Any:
        """The plain wrapper, remembering the arguments for the next recording.

        (Whether the caller still holds this call's results when the next one records
        says little: TorchDynamo keeps the values of the call it compiled on.)"""
        self.seen[key] = _seen(args)
        return self.fn(args)

    def _copy_held(self, entry: _Entry, args: list[torch.Tensor]) -> bool:
        """Slots that read these arguments but cannot replay because the caller holds
        a user-visible result of a forward graph (the slot's own, or one an earlier
        graph handed out whose memory the slot may reuse): that result is handed out
        as a copy from now on. A slot held up by nothing else is retired, up to
        RERECORDS times, so that this call records it again. True if one was."""
        retired = False
        for slot in list(entry.slots):
            if not slot.takes(args):
                continue
            own = slot.held(range(len(slot.tensors)))
            theirs = [(s, s.held(d, args, p)) for (s, d), p
                      in zip(slot.exposed, slot.exposed_args, strict=True)]
            for owner, indices in [(slot, own), *theirs]:
                new = {owner.positions[j] for j in indices} & owner.user - owner.copies
                if new:
                    owner.copies |= new
                    owner.held_once |= new
                    whose = "" if owner is slot else " of an earlier graph"
                    self.log(f"{self.recorded}; result(s) {sorted(new)}{whose} held past "
                             "the step that made them: handed out as copies from now on")
            if own and self.rerecords < RERECORDS and all(
                    slot.positions[j] in slot.copies & slot.user for j in own) \
                    and slot.unexposed(args) and (self.pool is None or self.pool.clear_after(slot)):
                self._record_again(entry, slot)
                retired = True
        return retired

    def _copy_later_held(self, entry: _Entry, args: list[torch.Tensor]) -> None:
        """A slot that could replay but for results of graphs recorded after it in
        the pool that the caller still holds (a training loop that zeroes the
        gradients after the forward: the last backward's gradients are the
        parameters' `.grad` while the forward runs): those results are handed out as
        copies from now on, so that the slot replays from the next call on."""
        if self.pool is None:
            return
        for slot in entry.slots:
            if not slot.takes(args):
                continue
            for other in self.pool.after(slot):
                new = {other.positions[j] for j in other.held(range(len(other.tensors)))}
                new -= other.copies
                if new:
                    other.copies |= new
                    other.held_once |= new  # its runner's: a new recording copies them
                    self.log(f"{self.recorded}; result(s) {sorted(new)} of a later graph "
                             "held when this one replays: handed out as copies from now on")

    def _record_again(self, entry: _Entry, slot: _Slot) -> None:
        """Retire `slot` so that this call records its graph again (one of RERECORDS)."""
        self.rerecords += 1
        entry.slots.remove(slot)
        self._retire([slot])

    def _retire(self, slots: list[_Slot]) -> None:
        if self.pool is not None:
            self.pool.forget(slots)

    def _pick(self, entry: _Entry, args: list[torch.Tensor]) -> _Slot | None:
        """A free slot that reads the arguments it reads in place where they are, and
        whose replay overwrites no result still held."""
        for slot in entry.slots:
            if slot.takes(args) and slot.free() and slot.unexposed(args) and (
                    self.pool is None or self.pool.clear_after(slot)):
                return slot
        return None

    def _capture(self, entry: _Entry, args: list[torch.Tensor],
                 seen: tuple[Any, ...] | None) -> Any:
        """Record a graph on these arguments into `entry` and return this call's
        results: those of the recording itself, the allocator's tensors, so that
        what the caller drops is memory a later recording in the pool may reuse. A
        failed recording turns replay off and returns the warm-up run's results."""
        # Read in place: parameters, results of recorded graphs (a backward graph's
        # saved activations) and the very tensors the previous call passed, at the same
        # address (an input buffer refilled in place); copy the rest into buffers.
        static = tuple(i for i, a in enumerate(args) if self._is_param(i)
                       or _storage(a) in _GRAPH_OUTPUTS or _storage(a) in _GRAPH_PARAMS
                       or (seen is not None and seen[i][0]() is a
                           and seen[i][1] == a.data_ptr()))
        try:
            if not self.mutated <= set(static):
                # a copy would take the update the caller's tensor must see
                raise RuntimeError("an input the graph writes into is not read in place")
            inputs = [a if i in static else a.clone() for i, a in enumerate(args)]
            warm = self._warm_up(inputs)
        except Exception as e:  # noqa: BLE001 - no graph: the plain wrapper stays
            self._turn_off(e)
            return self.fn(args)
        # What the slot needs of the arguments, taken before the recording frees them
        reads = _addresses(inputs)
        buffers = [None if i in static else a for i, a in enumerate(inputs)]
        places: dict[int, list[int]] = {}
        # (no loop variable over `inputs`: it would keep the last one, a backward's
        # incoming gradient, alive through the recording, which could not reuse it)
        for i, ptr in enumerate(map(_storage, inputs)):
            places.setdefault(ptr, []).append(i)
        given = {ptr: at[-1] for ptr, at in places.items()}
        # an argument's storage, weakly: an output at a freed argument's address is
        # the recording's own tensor (it took that memory), not a view of it
        alive = {ptr: StorageWeakRef(inputs[at[-1]].untyped_storage())
                 for ptr, at in places.items()}
        meta = [(a.dtype, int(a.storage_offset())) for a in inputs]
        where = ("the caller's tensors" if len(static) == len(args) else
                 f"{len(static)} argument(s) in place, {len(args) - len(static)} copied in"
                 f" ({_largest(args, static)})")
        _GRAPH_PARAMS.update(_storage(args[i]) for i in static if self._is_param(i))
        produced = tuple(i for i in static if _storage(args[i]) in _GRAPH_OUTPUTS)
        # arguments read in place that no recorded graph made (parameters, a refilled
        # input buffer): kept until the replay below has read them
        kept = [a for i, a in enumerate(inputs)
                if i in static and _storage(a) not in _GRAPH_OUTPUTS]
        if self.pool is not None:
            # The caller's references go (the boxed call's, as the plain wrapper's
            # do): the recording frees each activation at its last use, and its later
            # tensors take that memory, as eager's would (Pool).
            args.clear()
        try:
            replay, outputs = self._record(inputs)  # the wrapper empties `inputs`
        except Exception as e:  # noqa: BLE001 - no graph: the warm-up's results stand
            self._turn_off(e)
            if warm is None:
                raise
            results, applied = warm
            for dst, src in applied:
                dst.copy_(src)
            return results
        finally:
            inputs.clear()  # (a wrapper that does not: its arguments are not kept)
        # Results at the same memory in the warm-up run and the recording are none of
        # the recording's (the warm-up's are alive through it): constants the wrapper
        # holds, a causal mask folded once and saved for every attention layer. Handed
        # out as they are and read in place by later graphs, as parameters are; taken
        # for the graph's memory, their storages (alive for good) would keep the slot
        # from ever being free.
        constant = set() if warm is None else {
            i for i, (a, b) in enumerate(zip(warm[0], outputs, strict=False))
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and _storage(a) == _storage(b) != 0}  # (not two empty tensors)
        del warm
        # The warm-up's memory is cached for a side stream nothing else allocates on,
        # and the recording's for the graph's pool: without this the process would
        # keep reserving the warm-up's peak for good (training's largest share above
        # Inductor's reserved memory, which warms up in its graphs' pool). cuBLAS's
        # workspaces go first, as Inductor's CUDA-graph trees drop them around each
        # recording: the default stream's, made by the first, plain call, sat in the
        # middle of that call's freed activations and kept their segment reserved
        # (H200, allocator history: 220 of a 252 MB segment free in T5-small's
        # training, 94 of 126 in the Llama-style model's). The graph keeps using the
        # workspace its recording made, now memory its pool may give a later
        # recording: scratch that only this graph's replay writes, and which a later
        # graph's results never hold while it replays (`Pool.clear_after`).
        if _CLEAR_CUBLAS_WORKSPACES is not None:  # (CUDA builds of torch)
            _CLEAR_CUBLAS_WORKSPACES()
        torch.cuda.empty_cache()
        replay()
        del kept
        # the earlier graphs' results dead now, before the recording or in it (the
        # activations it freed): its tensors may sit in their memory
        exposed = self.pool.dead() if self.pool is not None else []
        exposed_args = [[tuple(places.get(_storage(slot.tensors[j]), ())) for j in dead]
                        for slot, dead in exposed]
        copies = set(self.held_once)
        tensors, positions, user = [], [], set()
        aliases: dict[int, tuple[int, Any, Any, int]] = {}
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                continue
            ptr = _storage(o)
            if i in constant and ptr not in given:
                _GRAPH_PARAMS.add(ptr)
                continue
            at = given.get(ptr)
            if at is not None and not alive[ptr].expired():
                if at not in static:
                    copies.add(i)  # over a buffer the next call refills
                elif o.dtype == meta[at][0]:  # its offset from the argument's
                    aliases[i] = (at, o.size(), o.stride(), int(o.storage_offset()) - meta[at][1])
                continue  # a view of a tensor the caller owns: not the graph's memory
            if self.user_outputs is not None and i < self.user_outputs \
                    and i not in self.applied:
                user.add(i)
            tensors.append(o)
            positions.append(i)
        kind: Any = type(outputs)  # a list or a tuple
        original = outputs
        kept_outputs = list(outputs)
        owners: list[Any] = []
        theirs: list[int] = []
        if self.pool is not None and self.DISOWN:
            # the slot keeps views that own nothing, but of the caller's results
            # (a loss it may keep for good, whose memory must stay the graph's)
            # (nor a view of a storage one of those shares: the slot's owning tensor
            # would keep its recording-call storage alive for good)
            keep = {_storage(tensors[j]) for j, p in enumerate(positions) if p in user}
            theirs = [j for j, p in enumerate(positions)
                      if p not in user and _storage(tensors[j]) not in keep]
            views = self._disown([tensors[j] for j in theirs])
            owners = [None] * len(tensors)
            for j, v in zip(theirs, views, strict=True):
                owners[j] = StorageWeakRef(tensors[j].untyped_storage())
                tensors[j] = kept_outputs[positions[j]] = v
        for i in aliases:
            kept_outputs[i] = None
        outputs = kind(kept_outputs)
        del kept_outputs
        storages = [o.untyped_storage() for o in tensors]
        handles = [st._cdata for st in storages]
        slot = _Slot(replay, reads, buffers, outputs, tensors,
                     [o.data_ptr() for o in tensors],
                     [torch._C._storage_Use_Count(h) for h in handles],
                     copies, static, storages, handles, positions, frozenset(user), exposed,
                     self.held_once, exposed_args=exposed_args, owners=owners,
                     disowned=tuple(theirs), produced=produced, aliases=aliases)
        _GRAPH_OUTPUTS.update(_storage(o) for o in tensors)
        if self.pool is not None:
            self.pool.slots.append(slot)
            self.pool.refresh = False
        entry.slots.append(slot)
        self.replays += 1
        held = f"; result(s) {sorted(self.held_once)} handed out as copies (held past " \
            "their step before)" if self.held_once else ""
        self.recorded = (f"CUDA graph recorded for {len(reads)} argument(s), reading {where}"
                         f"{held}: replayed from now on")
        self.log(self.recorded)
        args.clear()
        # this call's results, made after the slot counted its references: the
        # recording's tensors (copies where `copies` says)
        return kind(_handed_out(original, copies))

    def _turn_off(self, e: Exception) -> None:
        self.disabled = f"capture failed: {type(e).__name__}: {e}"
        self.log(f"CUDA graph off: {self.disabled}")
        torch.cuda.synchronize()

    def _warm_up(self, inputs: list[torch.Tensor]) -> tuple[Any, list[Any]] | None:
        """Run the wrapper once outside any recording, on a side stream (allocations
        and library handles made outside the capture). Its results, and the values it
        wrote into inputs the graph updates (put back: the replay after the recording
        updates them once), are this call's if the recording fails."""
        side = _warm_up_stream()
        side.wait_stream(torch.cuda.current_stream())
        before = [(inputs[i], inputs[i].clone()) for i in sorted(self.mutated)]
        with torch.cuda.stream(side):
            results = self.fn(list(inputs))
            applied = [(dst, dst.clone()) for dst, _ in before]
            for dst, src in before:
                dst.copy_(src)
        torch.cuda.current_stream().wait_stream(side)
        return results, applied

    @staticmethod
    def _disown(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views over the same memory whose storages own none of it (one per storage
        the tensors share), as Inductor's CUDA-graph trees rebuild their outputs."""
        made: dict[int, Any] = {}
        out = []
        for t in tensors:
            st = t.untyped_storage()
            alias = made.get(st.data_ptr())
            if alias is None:
                alias = made[st.data_ptr()] = torch._C._construct_storage_from_data_pointer(
                    st.data_ptr(), t.device, st.nbytes())
            out.append(torch.empty((0,), dtype=t.dtype, device=t.device).set_(
                alias, t.storage_offset(), t.size(), t.stride()))
        return out

    def _record(self, inputs: list[torch.Tensor]) -> tuple[Callable[[], Any], Sequence[Any]]:
        """Record `fn` on `inputs` as a CUDA graph: its replay and its outputs. The
        wrapper takes `inputs` itself, which it empties (boxed)."""
        graph = torch.cuda.CUDAGraph()
        pool = self.pool
        if pool is not None and pool.handle is None:
            pool.handle = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=None if pool is None else pool.handle):
                outputs = self.fn(inputs)
        except BaseException:
            _after_failed_capture(graph)
            raise
        return graph.replay, outputs


# Per device, the one stream every warm-up runs on: each stream gets cuBLAS
# workspaces of its own (32 MB each on an H200) that live as long as the process, so
# a stream per recording kept more with every graph recorded (T5-small's training
# step on an H200: 96 MB on three warm-up streams, 64 MB on one).
_WARM_UP_STREAMS: dict[int, Any] = {}


def _warm_up_stream() -> Any:
    device = torch.cuda.current_device()
    stream = _WARM_UP_STREAMS.get(device)
    if stream is None:
        stream = _WARM_UP_STREAMS[device] = torch.cuda.Stream()
    return stream


def _handed_out(outputs: Sequence[Any], copies: set[int]) -> list[Any]:
    """A graph's results as its caller gets them: each tensor detached, or copied
    where `copies` says, the copies in one call (a backward's gradients: a clone
    each costs a launch)."""
    out = [o.detach() if isinstance(o, torch.Tensor) and i not in copies else o
           for i, o in enumerate(outputs)]
    at = [i for i in copies if isinstance(out[i], torch.Tensor)]
    if at:
        srcs = [out[i] for i in at]
        dsts = [torch.empty_like(t) for t in srcs]
        torch._foreach_copy_(dsts, srcs)
        for i, t in zip(at, dsts, strict=True):
            out[i] = t
    return out


def _largest(args: Sequence[torch.Tensor], static: Sequence[int], top: int = 3) -> str:
    """The largest arguments copied into buffers at each replay, for the log."""
    copied = sorted((i for i in range(len(args)) if i not in static),
                    key=lambda i: -args[i].numel())
    return ", ".join(f"#{i} {list(args[i].shape)} {str(args[i].dtype).removeprefix('torch.')}"
                     for i in copied[:top])


def _after_failed_capture(graph: torch.cuda.CUDAGraph) -> None:
    """Undo what a capture that CUDA invalidated (a synchronising call inside it) leaves
    behind: its end then raises before the allocator stops sending this thread's
    allocations to the graph's pool, and before the default generator leaves capture
    mode, so every later random op on the device failed ("Offset increment outside
    graph capture") and the process was lost for every model after it."""
    device = torch.cuda.current_device()
    with contextlib.suppress(RuntimeError):  # already ended when the capture itself ended
        torch._C._cuda_endAllocateToPool(device, graph.pool())
    gen = torch.cuda.default_generators[device]
    with contextlib.suppress(RuntimeError, AttributeError):
        # a fresh copy of the state: the same seed and offset, out of capture mode
        gen.graphsafe_set_state(gen.clone_state())
