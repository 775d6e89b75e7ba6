"""CUDA-graph replay of inference graphs (runtime/cudagraphs.py, Options.cudagraphs).

The eligibility rules and the option run everywhere; replay itself needs a GPU.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

import rewritec
from rewritec import report
from rewritec.runtime.cudagraphs import CudaGraphRunner, eligible
from rewritec.engine.errors import RewritecError
from rewritec.options import Options


def _graph(fn, *args: torch.Tensor) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def test_only_pure_inference_graphs_are_eligible() -> None:
    x = torch.randn(4, 8)
    pure = _graph(lambda x: torch.relu(x) * 2.0, x)
    assert eligible(pure, "inference", aliased_outputs=False) is None
    assert "forward" in eligible(pure, "forward", aliased_outputs=False)
    assert "aliases" in eligible(pure, "inference", aliased_outputs=True)
    # functional random ops, as AOTAutograd's graphs hold them: fresh per replay
    noisy = _graph(lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[0]
                   + torch.bernoulli(x.sigmoid(), 0.5) + torch.rand_like(x), x)
    assert eligible(noisy, "inference", aliased_outputs=False) is None
    in_place = _graph(lambda x: torch.empty_like(x).bernoulli_(0.5) * x, x)
    assert "bernoulli_" in eligible(in_place, "inference", aliased_outputs=False)
    # a random op with a generator of its own (built by hand: make_fx cannot trace one)
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    drawn = graph.call_function(torch.ops.aten.rand.generator, ([4, 8],),
                                {"generator": torch.Generator()})
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (node, drawn)))
    seeded = SimpleNamespace(graph=graph)  # no code: a Generator has no source form
    assert "rand" in eligible(seeded, "inference", aliased_outputs=False)
    mutating = _graph(lambda x: x.add_(1.0), x)
    assert eligible(mutating, "inference", aliased_outputs=False) is not None


def test_only_graphs_of_fixed_layouts_key_every_call_alike() -> None:
    """A graph whose placeholders have one size and stride each (TorchDynamo compiles
    it again for another) keys its entries by nothing: a backward reading hundreds of
    saved activations built a key of each one's layout at every call. A graph with a
    symbolic size keys by each argument's layout, as before."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from rewritec.runtime.cudagraphs import fixed_layouts

    def f(x, y):
        return (x * 2 + y.t(),)

    x, y = torch.randn(4, 8), torch.randn(8, 4)
    assert fixed_layouts(make_fx(f, tracing_mode="fake")(x, y))
    assert not fixed_layouts(make_fx(f, tracing_mode="symbolic")(x, y))
    fixed = RecordingOnCpu(lambda a: f(*a), params=[False, False], mode="on",
                           kind="forward", user_outputs=1, fixed=True)
    assert fixed._key([x, y]) == fixed._key([x.t(), y.t()])
    keyed = RecordingOnCpu(lambda a: f(*a), params=[False, False], mode="on",
                           kind="forward", user_outputs=1)
    assert keyed._key([x, y]) != keyed._key([x[:2], y[:, :2]])
    # and it replays, with its results equal to the function's
    for _ in range(4):
        x, y = torch.randn(4, 8), torch.randn(8, 4)
        (got,) = fixed([x, y])
        torch.testing.assert_close(got, x * 2 + y.t())
        del got
    assert fixed.replays == 3 and fixed.plain == 0


def test_option_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Options.make().cudagraphs == "auto"
    monkeypatch.setenv("REWRITEC_CUDAGRAPHS", "off")
    assert Options.make().cudagraphs == "off"
    with pytest.raises(RewritecError, match="cudagraphs must be one of"):
        Options.make(cudagraphs="always")



class _OnCpu(CudaGraphRunner):
    """A runner that takes CPU tensors and warms up nothing (no CUDA to start)."""

    @staticmethod
    def _accepts(args):
        return True

    def _warm_up(self, inputs):
        return None


class RecordingOnCpu(_OnCpu):
    """The runner with a stand-in for CUDA-graph recording: a "replay" runs the
    wrapper again on what the graph reads (its own buffers, and the caller's
    tensors it reads in place, never kept alive by the recording) and writes the
    results into the recorded outputs, as a real replay overwrites the graph's memory."""

    DISOWN = False  # results here are CPU memory: the slot keeps them

    def __call__(self, args):
        self._args = list(args)
        try:
            return super().__call__(args)
        finally:
            self._args = []

    def _record(self, inputs):
        # a graph keeps its own buffers alive, not the caller's tensors
        owned = [None if inp is a else inp for inp, a in zip(inputs, self._args, strict=True)]
        outputs = self.fn(list(inputs))
        # nor the results that view the caller's tensors (a real graph holds no tensor)
        callers = {a.untyped_storage().data_ptr() for a in self._args}
        written = [o if isinstance(o, torch.Tensor)
                   and o.untyped_storage().data_ptr() not in callers else None for o in outputs]

        def replay() -> None:
            now = [o if o is not None else a for o, a in zip(owned, self._args, strict=True)]
            for out, new in zip(written, self.fn(now), strict=True):
                if out is not None:
                    out.copy_(new)

        return replay, outputs


class DisowningOnCpu(_OnCpu):
    """The runner with a stand-in for recording into a pool, as on a GPU: each result
    the recording makes lives in memory the stand-in keeps (the pool's), and what the
    recording call hands out are tensors over that memory that own none of it, so
    they die as the allocator's do there. A replay runs the wrapper again on what the
    graph reads and writes the results into that memory. Memory reuse inside the
    pool is not modelled: only who holds what, and when a graph may replay."""

    def __call__(self, args):
        self._now, self._ids = args, [id(a) for a in args]
        try:
            return super().__call__(args)
        finally:
            self._now = None  # (a plain run's list is the caller's: kept by no one)

    def _warm_up(self, inputs):
        """A run before the recording, as on a GPU, whose results live through it: a
        result at the same memory in both is none of the recording's (a constant the
        wrapper holds), and the recording hands it out as it is."""
        if self.mutated:
            return None
        results = self.fn(list(inputs))
        self._warm = {o.untyped_storage().data_ptr() for o in results
                      if isinstance(o, torch.Tensor)}
        return results, []

    def _record(self, inputs):
        buffers = [None if id(x) == i else x for x, i in zip(inputs, self._ids, strict=True)]
        theirs = {x.untyped_storage().data_ptr() for x in inputs} | getattr(self, "_warm", set())
        self._warm = set()
        self._first = list(inputs)  # what the replay right after the recording reads
        outputs = self.fn(inputs)
        places, handed = [], []
        made = {}  # results sharing a storage share the pool's memory, as on a GPU
        for o in outputs:
            if not isinstance(o, torch.Tensor) or o.untyped_storage().data_ptr() in theirs:
                places.append(None)
                handed.append(o)
                continue
            key = o.untyped_storage().data_ptr()
            if key not in made:
                memory = torch.empty(o.untyped_storage().nbytes(), dtype=torch.uint8)
                self.memory = [*getattr(self, "memory", []), memory]
                made[key] = memory, torch._C._construct_storage_from_data_pointer(
                    memory.data_ptr(), o.device, memory.numel())
            memory, view = made[key]
            place = torch.empty(0, dtype=o.dtype).set_(
                memory.untyped_storage(), o.storage_offset(), o.size(), o.stride())
            places.append(place)
            handed.append(torch.empty(0, dtype=o.dtype).set_(
                view, o.storage_offset(), o.size(), o.stride()))

        runner = weakref.ref(self)  # a real graph's replay keeps no runner alive

        def replay() -> None:
            me = runner()
            reads, me._first = (me._first or me._now), None
            now = [b if b is not None else a for b, a in zip(buffers, reads, strict=True)]
            for place, new in zip(places, me.fn(now), strict=True):
                if place is not None:
                    place.copy_(new)

        return replay, type(outputs)(handed)


def _runner():
    def wrapper(args):  # what a compiled graph's wrapper is: boxed arguments, a tuple out
        x, w = args
        return (x * 2 + w, x.sum(0))

    return RecordingOnCpu(wrapper, params=[False, True], mode="on"), torch.randn(4)


def _eager(x, w):
    return (x * 2 + w, x.sum(0))


def _check(got, x, w) -> None:
    for g, e in zip(got, _eager(x, w), strict=True):
        torch.testing.assert_close(g, e)


def test_a_loop_holding_its_last_result_alternates_two_graphs() -> None:
    runner, w = _runner()
    y = None
    for _ in range(8):
        x = torch.randn(3, 4)
        y = runner([x, w])  # the previous y is alive while this call runs
        _check(y, x, w)
    entry, = runner.graphs.values()
    assert len(entry.slots) == 2 and runner.plain == 0
    assert all(s.static == (1,) for s in entry.slots)  # new tensors: copied in, w read


def test_results_still_held_are_never_overwritten() -> None:
    runner, w = _runner()
    xs = [torch.randn(3, 4) for _ in range(6)]
    kept = [runner([x, w]) for x in xs]
    view = runner([xs[0], w])[0].view(-1)  # only a view of a result survives
    later = runner([xs[1], w])
    for x, got in zip(xs, kept, strict=True):
        _check(got, x, w)
    torch.testing.assert_close(view, _eager(xs[0], w)[0].view(-1))
    _check(later, xs[1], w)
    assert runner.plain >= 4  # both graphs busy: the plain wrapper ran those calls


def test_an_input_refilled_in_place_is_read_where_it_is() -> None:
    runner, w = _runner()
    x = torch.randn(3, 4)
    for _ in range(5):
        x.copy_(torch.randn(3, 4))
        _check(runner([x, w]), x, w)
    entry, = runner.graphs.values()
    assert len(entry.slots) == 1 and entry.slots[0].static == (0, 1)
    other = torch.randn(3, 4)  # another tensor: not the one the graph reads
    _check(runner([other, w]), other, w)
    assert len(entry.slots) == 2 and entry.slots[1].static == (1,)


def test_a_result_resized_away_from_the_graph_memory_retires_its_graph() -> None:
    runner, w = _runner()
    x = torch.randn(3, 4)
    runner([x, w])
    first = runner([x, w])[0]  # recorded, replayed
    first.resize_(10_000)  # new memory for the shared storage
    del first
    for _ in range(3):
        x = torch.randn(3, 4)
        _check(runner([x, w]), x, w)


def test_a_parameter_updated_in_place_records_again() -> None:
    runner, w = _runner()
    x = torch.randn(3, 4)
    for _ in range(3):
        runner([x, w])
    w.add_(1.0)
    for _ in range(3):
        _check(runner([x, w]), x, w)
    another = torch.randn(4)  # a different parameter tensor: never written into
    _check(runner([x, another]), x, another)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(self.ln(x)))


@cuda
def test_replay_matches_eager_and_keeps_earlier_results() -> None:
    torch.manual_seed(0)
    model = Block().cuda().eval()
    compiled = rewritec.compile(model, cudagraphs="on", strict=True)
    xs = [torch.randn(8, 16, 64, device="cuda") for _ in range(4)]
    with torch.no_grad():
        outs = [compiled(x) for x in xs]  # the 2nd call captures, later ones replay
        for x, out in zip(xs, outs, strict=True):
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
        # a parameter updated in place: the graph is recorded again
        model.fc.bias.add_(1.0)
        for _ in range(3):
            torch.testing.assert_close(compiled(xs[0]), model(xs[0]), rtol=1e-4, atol=1e-4)
        # a new shape gets its own graph; CPU tensors never reach a graph
        y = torch.randn(3, 5, 64, device="cuda")
        for _ in range(3):
            torch.testing.assert_close(compiled(y), model(y), rtol=1e-4, atol=1e-4)
    assert any("recorded" in r.cudagraphs for r in report.RECORDS)



@cuda
def test_replay_of_a_loop_and_of_a_refilled_input_matches_eager() -> None:
    """Real CUDA graphs: a buffer refilled in place is read where it is, a loop
    `y = f(x)` over new tensors alternates graphs, and a result kept aside is never
    overwritten by later replays."""
    torch.manual_seed(0)
    model = Block().cuda().eval()
    compiled = rewritec.compile(model, cudagraphs="on", strict=True)
    x = torch.randn(8, 16, 64, device="cuda")
    with torch.no_grad():
        y = None
        for _ in range(5):
            x.copy_(torch.randn_like(x))
            y = compiled(x)
            torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
        kept, kept_x = y, x.clone()
        for _ in range(5):
            z = torch.randn_like(x)
            y = compiled(z)
            torch.testing.assert_close(y, model(z), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kept, model(kept_x), rtol=1e-4, atol=1e-4)

@cuda
def test_auto_leaves_short_graphs_alone() -> None:
    """Under auto, a graph of a few launches runs plainly (copies would cost more)."""
    model = Block().cuda().eval()
    report.reset()
    compiled = rewritec.compile(model, strict=True)
    x = torch.randn(2, 4, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    decided = [r.cudagraphs for r in report.RECORDS if r.cudagraphs]
    assert decided and all("fewer than" in d for d in decided)


def test_auto_threshold_counts_launches_and_products() -> None:
    """auto replays graphs of 3+ launches without matrix products (Python-bound:
    conv + epilogues), but needs 12+ where cuBLAS products keep the GPU busy."""
    from rewritec.runtime.cudagraphs import auto_declines

    pointwise, row = {"matrix_products": False}, {"matrix_products": False}
    conv_block = {"convolution": 1}, [pointwise, pointwise]
    assert auto_declines(*conv_block) is None
    mlp = {"addmm": 2}, [pointwise]
    assert "with matrix products, fewer than 12" in auto_declines(*mlp)
    attention = {}, [{"matrix_products": True}] * 2 + [row] * 2
    assert "fewer than 12" in auto_declines(*attention)
    one_kernel = {}, [row]
    assert "1 launch(es) without matrix products, fewer than 3" in auto_declines(*one_kernel)
    many = {"addmm": 6}, [row] * 6
    assert auto_declines(*many) is None


def test_the_kinds_that_compute_matrix_products_say_so() -> None:
    """kinds/kind.py: matrix_products, which a kernel's report record carries to
    auto_declines, in place of a list of template names."""
    from rewritec.kinds.registry import KINDS

    assert {n for n, k in KINDS.items() if k.matrix_products} == {"matmul", "attention"}


@pytest.fixture(autouse=True)
def _no_graph_outputs_of_earlier_tests() -> None:
    """The runners remember the storages their graphs return, process-wide; one an
    earlier test's graph returned may be where the CPU allocator puts a tensor here,
    which would then be read in place and change what these tests count."""
    from rewritec.runtime import cudagraphs

    cudagraphs._GRAPH_OUTPUTS.clear()
    cudagraphs._GRAPH_PARAMS.clear()


def _training_pair():
    """A forward and a backward runner sharing a pool, as compile_fx makes them for
    one training graph: forward (x, w) -> (loss, saved), backward (saved, g) -> dw."""
    from rewritec.runtime.cudagraphs import Pool

    def forward(args):
        x, w = args
        h = x * w
        return ((h * h).sum(), h)

    def backward(args):
        h, g = args
        return ((h * 2 * g).sum(0),)

    pool = Pool()
    fw = RecordingOnCpu(forward, params=[False, True], mode="on", kind="forward",
                        user_outputs=1, pool=pool)
    bw = RecordingOnCpu(backward, params=[], mode="on", kind="backward", pool=pool)
    return fw, bw, pool


def test_training_graphs_copy_the_loss_out_and_read_saved_activations_in_place() -> None:
    fw, bw, pool = _training_pair()
    w = torch.randn(4)
    losses, grads = [], []
    for _ in range(6):
        x = torch.randn(3, 4)
        loss, saved = fw([x, w])
        (dw,) = bw([saved, torch.ones(())])
        del saved  # autograd frees the activations in the backward
        losses.append((loss, x, w.clone()))
        grads.append(dw.clone())
        del dw
        torch.testing.assert_close(grads[-1], (2 * x * w).sum(0))
        w.sub_(0.1 * grads[-1])  # an optimizer step: in place, and no new recording
    # every loss is still what it was: the forward hands copies out
    for loss, x, w_then in losses:
        torch.testing.assert_close(loss, ((x * w_then) ** 2).sum())
    (fw_slot,) = fw.graphs[next(iter(fw.graphs))].slots
    (bw_slot,) = bw.graphs[next(iter(bw.graphs))].slots
    assert fw_slot.static == (1,) and fw_slot.copies == {0}  # held since the first step
    assert 0 in bw_slot.static  # the saved activation: the forward graph's memory
    assert fw.plain == bw.plain == 0 and fw.replays == bw.replays == 5
    assert pool.slots == [fw_slot, bw_slot]


def _disowning_pair():
    """`_training_pair` recorded as into a pool on a GPU (DisowningOnCpu)."""
    from rewritec.runtime.cudagraphs import Pool

    fw, bw, _ = _training_pair()
    pool = Pool()
    return (DisowningOnCpu(fw.fn, params=[False, True], mode="on", kind="forward",
                           user_outputs=1, pool=pool),
            DisowningOnCpu(bw.fn, params=[], mode="on", kind="backward", pool=pool), pool)


def _step(fw, bw, x, w):
    """One training step as AOTAutograd runs one: the backward takes the saved
    activation from a list it hands over (boxed), so nothing else holds it."""
    loss, *saved = fw([x, w])
    args = [*saved, torch.ones(())]
    del saved
    return loss, bw(args)


def _steps(fw, bw, n: int) -> None:
    """`n` training steps of the pair, each checked against its formula."""
    w = torch.randn(4)
    for _ in range(n):
        x = torch.randn(3, 4)
        loss, (dw,) = _step(fw, bw, x, w)
        torch.testing.assert_close(loss, ((x * w) ** 2).sum())
        torch.testing.assert_close(dw, (2 * x * w).sum(0))
        del loss, dw


def test_a_pooled_graph_keeps_no_activation_alive_for_the_backward_to_reuse() -> None:
    """In a pool, a forward graph's slot keeps its saved activations over memory it
    does not own: once the recording call's activations die in the backward (whose
    recording may then reuse that memory), nothing holds them; the backward replays
    while the only references to them are its own arguments."""
    fw, bw, pool = _disowning_pair()
    _steps(fw, bw, 5)
    (fw_slot,) = next(iter(fw.graphs.values())).slots
    (bw_slot,) = next(iter(bw.graphs.values())).slots
    assert fw_slot.disowned == (1,)  # the activation; the loss is the caller's
    assert fw_slot.owned() == [] and fw_slot.free()
    assert [(s, d) for s, d in bw_slot.exposed] == [(fw_slot, [1])]
    assert bw_slot.exposed_args == [[(0,)]]  # read, and freed, by the backward itself
    assert fw.replays == bw.replays == 4 and fw.plain == bw.plain == 0
    assert pool.slots == [fw_slot, bw_slot] and not pool.refresh


def test_a_constant_saved_at_several_positions_holds_no_graph() -> None:
    """A folded constant (a causal mask) the forward saves for every attention layer
    is the wrapper's memory, not the recording's: handed out as it is, read in place
    by the backward, and never taken for a result the caller holds (on an H200 its
    storage, alive for good, kept the forward slot from replaying: 1 replay and 6
    plain runs in 7 steps)."""
    from rewritec.runtime.cudagraphs import Pool

    mask = torch.ones(3, 4).tril()

    def fw(a):
        x, w = a
        h = x * w
        return ((h * mask).sum(), mask, h, mask)  # the loss; saved: mask, h, mask

    def bw(a):
        m1, h, m2, g = a
        return ((m1 + m2) * h.sign().abs() * g).sum(0),

    pool = Pool()
    f = DisowningOnCpu(fw, params=[False, True], mode="on", kind="forward",
                       user_outputs=1, pool=pool)
    b = DisowningOnCpu(bw, params=[], mode="on", kind="backward", pool=pool)
    w = torch.randn(4)
    for _ in range(6):
        x = torch.randn(3, 4)
        loss, *saved = f([x, w])
        assert all(m.data_ptr() == mask.data_ptr() for m in saved[::2])
        args = [*saved, torch.ones(())]
        del saved
        (dw,) = b(args)
        torch.testing.assert_close(loss, (x * w * mask).sum())
        torch.testing.assert_close(dw, 2 * (mask * (x * w).sign().abs()).sum(0))
        del loss, dw
    (f_slot,) = next(iter(f.graphs.values())).slots
    assert f.replays == b.replays == 5 and f.plain == b.plain == 0
    assert f_slot.positions == [0, 2]  # the loss and h: the masks are none of its memory
    assert {0, 2} <= set(next(iter(b.graphs.values())).slots[0].static)  # the masks


def test_a_backward_first_seen_after_its_forward_recorded_records_with_it() -> None:
    """A backward whose arguments first qualify once the forward replays (what
    T5-small's training step on an H200 looked like: its backward never recorded)
    would record over activations the allocator counts as free: it runs plainly, the
    forward records again at the next step, and both replay from then on."""
    fw, bw, pool = _disowning_pair()
    calls = []
    bw._accepts = lambda args: bool(calls.append(1)) or len(calls) > 1
    _steps(fw, bw, 7)
    assert fw.rerecords == 1 and bw.plain == 1 and not pool.refresh
    assert fw.replays == 6 and bw.replays == 4
    assert [len(e.slots) for e in bw.graphs.values()] == [1]


def test_gradients_zeroed_after_the_forward_are_copied_out_and_both_replay() -> None:
    """A loop that zeroes the gradients after the forward (`loss = model(x);
    opt.zero_grad(); loss.backward()`) holds the last backward's results while the
    forward runs, which a replay of the forward could overwrite: that forward runs
    plainly once, the backward hands those results out as copies from then on, and
    both replay after that; what the caller held never changes."""
    fw, bw, _ = _disowning_pair()
    w = torch.randn(4)
    grad = None
    for _ in range(8):
        x = torch.randn(3, 4)
        kept = None if grad is None else grad.clone()
        loss, *saved = fw([x, w])
        if grad is not None:
            torch.testing.assert_close(grad, kept)  # untouched by the forward
        grad = None  # zero_grad(set_to_none=True), after the forward
        args = [*saved, torch.ones(())]
        del saved
        (grad,) = bw(args)
        torch.testing.assert_close(loss, ((x * w) ** 2).sum())
        torch.testing.assert_close(grad, (2 * x * w).sum(0))
        del loss
    (bw_slot,) = next(iter(bw.graphs.values())).slots
    assert bw_slot.copies == {0}
    assert fw.plain == 1 and bw.plain == 1 and fw.replays == 6 and bw.replays == 6


def test_activations_held_past_their_backward_are_never_recorded_over() -> None:
    """Two forwards before their backwards (gradient accumulation): the first one's
    activations, over memory the allocator counts as free, are still held while the
    second runs plainly; no recording happens while they are, and every result and
    activation keeps its value."""
    fw, bw, pool = _disowning_pair()
    w = torch.randn(4)
    for _ in range(6):
        xs = [torch.randn(3, 4), torch.randn(3, 4)]
        outs = [fw([x, w]) for x in xs]
        wants = [(x * w).clone() for x in xs]
        for (loss, saved), want, x in zip(reversed(outs), reversed(wants), reversed(xs),
                                          strict=True):
            torch.testing.assert_close(saved, want)
            (dw,) = bw([saved, torch.ones(())])
            torch.testing.assert_close(dw, (2 * x * w).sum(0))
            torch.testing.assert_close(loss, ((x * w) ** 2).sum())
            del dw
        del outs, loss, saved
    assert fw.replays >= 4 and bw.replays >= 4


def _split_pair():
    """Two compiled pieces of one step, as TorchDynamo splits a model and its loss at
    a graph break: a forward graph whose user result (logits) the loss graph reads."""
    from rewritec.runtime.cudagraphs import Pool

    model = RecordingOnCpu(lambda a: (a[0] @ a[1],), params=[False, True], mode="on",
                           kind="forward", user_outputs=1, pool=Pool())
    loss = RecordingOnCpu(lambda a: (a[0].logsumexp(1).sum(), a[0][1:]), params=[False],
                          mode="on", kind="forward", user_outputs=1, pool=Pool())
    return model, loss


def _broken_step_runners(pool):
    """The four graphs of a training step with a graph break before its loss (GPT-2
    and T5 in HF's code), as DisowningOnCpu runners in `pool`: the model's forward
    (x, w) -> (logits, h) and the loss's (logits) -> (loss, p), then the loss's
    backward (p, g) -> (dlogits,) and the model's (h, w, dlogits) -> (dw,)."""
    def model_fw(a):
        x, w = a
        return (x @ w, x.clone())

    def loss_fw(a):
        return (a[0].logsumexp(1).sum(), a[0].softmax(1))

    def loss_bw(a):
        return (a[0] * a[1],)

    def model_bw(a):
        h, _w, d = a
        return (h.t() @ d,)

    def runner(fn, kind, **kw):
        return DisowningOnCpu(fn, mode="on", kind=kind, pool=pool, **kw)

    return (runner(model_fw, "forward", params=[False, True], user_outputs=1),
            runner(loss_fw, "forward", params=[False], user_outputs=1),
            runner(loss_bw, "backward", params=[]), runner(model_bw, "backward", params=[]))


def _broken_steps(runners, w, n: int) -> None:
    fw1, fw2, bw2, bw1 = runners
    for _ in range(n):
        x = torch.randn(3, 4)
        logits, *saved1 = fw1([x, w])
        loss, *saved2 = fw2([logits])
        del logits  # autograd keeps what the backward needs, not the logits
        args = [*saved2, torch.ones(())]
        del saved2
        (dlogits,) = bw2(args)
        args = [*saved1, w.detach(), dlogits]
        del saved1, dlogits
        (dw,) = bw1(args)
        want = x @ w
        torch.testing.assert_close(loss, want.logsumexp(1).sum())
        torch.testing.assert_close(dw, x.t() @ want.softmax(1))
        del loss, dw


def test_a_backward_recorded_into_a_pool_may_reuse_its_incoming_gradient() -> None:
    """Four graphs of a step with a graph break before its loss, in one pool: the
    model's backward, recorded after the loss's, may reuse the memory of the loss's
    gradient once it has read it (the recording kept its last argument alive through
    a loop variable), all four replay with eager's values, and retired slots leave
    the pool."""
    from rewritec.runtime.cudagraphs import Pool

    pool = Pool()
    runners = _broken_step_runners(pool)
    _broken_steps(runners, torch.randn(4, 6), 6)
    slots = [s for r in runners for e in r.graphs.values() for s in e.slots]
    assert len(slots) == 4 and sorted(map(id, pool.slots)) == sorted(map(id, slots))
    assert [r.replays for r in runners] == [5] * 4 and [r.plain for r in runners] == [0] * 4
    _, _, bw2_slot, bw1_slot = slots
    assert any(s is bw2_slot and d == [0] for s, d in bw1_slot.exposed)
    pool.handle = "a pool id"
    runners[3]._retire([bw1_slot])
    assert len(pool.slots) == 3 and pool.handle == "a pool id"
    pool.forget(slots)
    assert pool.slots == [] and pool.handle is None


def test_a_result_the_next_graph_reads_is_handed_out_uncopied_and_read_in_place() -> None:
    model, loss = _split_pair()
    w = torch.randn(4, 6)
    x = torch.randn(3, 4)  # an input buffer refilled in place
    for _ in range(5):
        x.copy_(torch.randn(3, 4))
        (logits,) = model([x, w])
        total, saved = loss([logits])
        torch.testing.assert_close(total, (x @ w).logsumexp(1).sum())
        torch.testing.assert_close(saved, (x @ w)[1:])  # a view of its argument
        del logits, saved, total
    (m_slot,) = next(iter(model.graphs.values())).slots
    (l_slot,) = next(iter(loss.graphs.values())).slots
    assert m_slot.copies == set() and l_slot.copies == set()
    assert l_slot.static == (0,)  # the logits: the model graph's memory, no copy
    assert list(l_slot.aliases) == [1]  # rebuilt from the logits, not held by the slot
    assert model.replays == loss.replays == 4 and model.plain == loss.plain == 0


def test_a_result_held_from_some_step_on_is_kept_and_copied_from_then_on() -> None:
    """A caller that starts keeping the logits: what it keeps never changes, that
    result is handed out as a copy from then on, and the graph is recorded again
    (not run plainly for good) while the caller still holds the first one."""
    model, loss = _split_pair()
    lines = []
    model.log = lines.append
    w = torch.randn(4, 6)
    x = torch.randn(3, 4)
    kept = []
    for step in range(8):
        x.copy_(torch.randn(3, 4))
        (logits,) = model([x, w])
        loss([logits])
        if step >= 3:
            kept.append((logits, x @ w))
        del logits
    for got, want in kept:
        torch.testing.assert_close(got, want)
    (m_slot,) = next(iter(model.graphs.values())).slots
    assert m_slot.copies == {0}
    assert model.rerecords == 1 and model.plain == 0 and model.replays == 7
    # the report's line for the graph says so, after the recording that followed
    assert "recorded" in lines[-1] and "result(s) [0] handed out as copies" in lines[-1]


def test_a_graph_never_writes_over_a_held_result_whose_memory_it_may_reuse() -> None:
    """The backward was recorded while the forward's user result was dead (so its
    temporaries may sit in that memory); a caller holding that result later makes
    the backward run plainly, and the forward copy it out from then on."""
    fw, bw, _ = _training_pair()
    w = torch.randn(4)
    for _ in range(3):
        loss, saved = fw([torch.randn(3, 4), w])
        del loss  # dead before the backward runs: the recording may reuse it
        bw([saved, torch.ones(())])
        del saved
    x = torch.randn(3, 4)
    loss, saved = fw([x, w])
    want = loss.clone()
    (dw,) = bw([saved, torch.ones(())])
    assert bw.plain == 1  # the held loss is among what the backward may overwrite
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(dw, (2 * x * w).sum(0))
    (fw_slot,) = fw.graphs[next(iter(fw.graphs))].slots
    assert fw_slot.copies == {0}
    (bw_slot,) = bw.graphs[next(iter(bw.graphs))].slots
    assert bw_slot.exposed and bw_slot.exposed[0][0] is fw_slot


def test_running_statistics_are_handed_out_uncopied_and_weights_read_in_place() -> None:
    """A forward whose first result is a buffer's new value (AOTAutograd copies it
    into the buffer as soon as the call returns: `applied`) hands it out without a
    copy of its own; the backward reads the weight the forward read in place (a
    parameter passed on to it) instead of copying it into a buffer every replay."""
    from rewritec.runtime.cudagraphs import Pool

    def forward(args):
        x, w, stat = args
        h = x * w
        return (stat * 0.9 + h.mean(0) * 0.1, (h * h).sum(), h)

    def backward(args):
        h, w, g = args
        return ((h * 2 * g * w).sum(0),)

    pool = Pool()
    fw = RecordingOnCpu(forward, params=[False, True, True], mode="on", kind="forward",
                        user_outputs=2, applied=[0], pool=pool)
    bw = RecordingOnCpu(backward, params=[], mode="on", kind="backward", pool=pool)
    w, stat = torch.randn(4), torch.zeros(4)
    for _ in range(5):
        x = torch.randn(3, 4)
        want = stat * 0.9 + (x * w).mean(0) * 0.1
        new_stat, loss, saved = fw([x, w, stat])
        stat.copy_(new_stat)  # what AOTAutograd's runtime does at once
        del new_stat
        torch.testing.assert_close(stat, want)
        torch.testing.assert_close(loss, ((x * w) ** 2).sum())
        # autograd hands saved tensors back as new tensor objects over their storage
        (dw,) = bw([saved, w.detach(), torch.ones(())])
        torch.testing.assert_close(dw, (2 * x * w * w).sum(0))
        del saved, dw
    (fw_slot,) = fw.graphs[next(iter(fw.graphs))].slots
    (bw_slot,) = bw.graphs[next(iter(bw.graphs))].slots
    assert fw_slot.copies == {1}  # the loss, which the loop holds into the next call
    assert bw_slot.static == (0, 1)  # the saved activation and the forward's weight
    assert fw.replays == bw.replays == 4 and fw.plain == bw.plain == 0


def test_an_applied_result_still_held_is_never_overwritten() -> None:
    """A buffer's new value the caller keeps (not what AOTAutograd does, but a
    caller may) blocks the next replay rather than change under it."""
    fw = RecordingOnCpu(lambda a: (a[0] * 2.0, a[0].sum()), params=[True], mode="on",
                        kind="forward", user_outputs=2, applied=[0])
    x = torch.randn(4)
    for _ in range(3):
        fw([x])
    held, _ = fw([x])
    expected = held.clone()
    x.add_(1.0)
    out, _ = fw([x])
    torch.testing.assert_close(held, expected)
    torch.testing.assert_close(out, x * 2.0)


def test_a_graph_recorded_earlier_never_overwrites_a_later_ones_held_result() -> None:
    """The backward's gradient, kept (as AccumulateGrad keeps a first gradient in
    .grad), may sit in memory the forward uses for temporaries: the forward runs
    plainly until it is released."""
    fw, bw, _ = _training_pair()
    w = torch.randn(4)
    for _ in range(2):
        _, saved = fw([torch.randn(3, 4), w])
        (held,) = bw([saved, torch.ones(())])
        del saved
    x = torch.randn(3, 4)
    loss, saved = fw([x, w])
    assert fw.plain == 1  # the held gradient blocks the replay
    torch.testing.assert_close(loss, ((x * w) ** 2).sum())
    del held, saved
    loss, saved = fw([x, w])
    assert fw.plain == 1 and fw.replays >= 1
    torch.testing.assert_close(loss, ((x * w) ** 2).sum())


def test_a_tensor_that_happened_to_sit_at_the_same_address_is_recorded_again() -> None:
    """A graph reads in place only the very tensor the previous call passed; if it
    later gets another, a free graph is recorded again rather than run plainly."""
    runner = RecordingOnCpu(lambda a: (a[0] * 2,), params=[False], mode="on",
                            kind="forward", user_outputs=1)
    x = torch.randn(5)
    for _ in range(3):
        torch.testing.assert_close(runner([x])[0], x * 2)
    (slot,) = next(iter(runner.graphs.values())).slots
    assert slot.static == (0,)
    for _ in range(3):
        y = torch.randn(5)
        torch.testing.assert_close(runner([y])[0], y * 2)
    assert runner.rerecords == 1 and runner.plain == 0


class TrainBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)
        self.fc1 = torch.nn.Linear(64, 128)
        self.fc2 = torch.nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


@cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_reduce_overhead_training_matches_eager_step_after_step(autocast: bool) -> None:
    """mode="reduce-overhead" replays the forward and backward graphs of training:
    losses, gradients and SGD-updated weights equal eager's over several steps, and
    a loss kept from an early step is never overwritten by a later replay."""
    torch.manual_seed(0)
    model = TrainBlock().cuda()
    ref = TrainBlock().cuda()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="rewritec", mode="reduce-overhead")
    report.reset()
    kept = []
    for _ in range(6):
        x = torch.randn(8, 16, 64, device="cuda")
        outs = []
        for m, fn in ((model, compiled), (ref, ref)):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                loss = fn(x).float().pow(2).mean()
            loss.backward()
            outs.append((loss, [p.grad.clone() for p in m.parameters()]))
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.01 * p.grad
        tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(outs[0][0], outs[1][0], **tol)
        for g, e in zip(outs[0][1], outs[1][1], strict=True):
            torch.testing.assert_close(g, e, **tol)
        kept.append((outs[0][0], outs[1][0].detach().clone()))
    for got, want in kept:
        torch.testing.assert_close(got, want, **tol)
    decided = [r.cudagraphs for r in report.RECORDS if r.kind in ("forward", "backward")]
    assert decided and all("recorded" in d for d in decided), decided


@cuda
def test_reduce_overhead_a_loss_after_a_graph_break_reads_the_logits_in_place() -> None:
    """A model and its loss compiled as two graphs (a graph break between them, as
    in HF's language models): the loss graph reads the model graph's logits where
    they are, losses and gradients equal eager's, and logits a caller keeps from
    some step on never change."""
    torch.manual_seed(0)
    model, ref = TrainBlock().cuda(), TrainBlock().cuda()
    ref.load_state_dict(model.state_dict())

    def step(m, x, t):
        logits = m(x)
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), t), logits

    compiled = torch.compile(step, backend="rewritec", mode="reduce-overhead")
    report.reset()
    kept = []
    for i in range(7):
        x = torch.randn(8, 16, 64, device="cuda")
        t = torch.randint(64, (8 * 16,), device="cuda")
        got = []
        for m, fn in ((model, compiled), (ref, step)):
            m.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
            loss, logits = fn(m, x, t)
            loss.backward()
            got.append((loss.detach(), logits, [p.grad.clone() for p in m.parameters()]))
        torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-4, atol=1e-4)
        for g, e in zip(got[0][2], got[1][2], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        if i >= 4:
            kept.append((got[0][1], got[1][1].detach().clone()))
        del got
    for held, want in kept:
        torch.testing.assert_close(held, want, rtol=1e-4, atol=1e-4)
    decided = [r.cudagraphs for r in report.RECORDS if r.kind in ("forward", "backward")]
    assert len(decided) >= 4 and all("recorded" in d for d in decided), decided
    assert any("as copies" in d for d in decided), decided  # the kept logits


class Deep(torch.nn.Module):
    """Weights about as large as the activations a layer saves: a training step's
    weight gradients fill what its freed activations held, in eager."""

    def __init__(self, width: int = 2048, depth: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _pool_bytes() -> int:
    """Bytes the allocator holds in private pools (CUDA graphs' memory)."""
    return sum(s["total_size"] for s in torch.cuda.memory._snapshot()["segments"]
               if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


@cuda
def test_reduce_overhead_training_reuses_freed_activations_as_eager_does() -> None:
    """The backward graph's recording reuses the memory of each activation it has
    read for the last time (the forward graph's results, which its slot no longer
    owns), so the graphs' pool holds about what an eager step peaks at, not the
    saved activations plus every gradient; and the steps still equal eager's."""
    torch.manual_seed(0)
    model, ref = Deep().cuda(), Deep().cuda()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4096, 2048, device="cuda")

    def step(m, fn):
        m.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        loss = fn(x).square().mean()
        loss.backward()
        return loss.detach()

    step(ref, ref)
    torch.cuda.synchronize()
    ref.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(ref, ref)
    torch.cuda.synchronize()
    eager_peak = torch.cuda.max_memory_allocated() - base
    before = _pool_bytes()
    compiled = torch.compile(model, backend="rewritec", mode="reduce-overhead")
    for _ in range(4):
        got, want = step(model, compiled), step(ref, ref)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    pool = _pool_bytes() - before
    print(f"pool {pool / 2**20:.0f} MB, eager peak {eager_peak / 2**20:.0f} MB")
    # and the cuBLAS workspace the recording stream needs (32 MB on an H200)
    assert pool <= 1.1 * eager_peak + (40 << 20), (pool / 2**20, eager_peak / 2**20)


@cuda
def test_reduce_overhead_zeroing_gradients_after_the_forward_still_replays() -> None:
    """`loss = model(x); opt.zero_grad(); loss.backward(); opt.step()`: the last
    step's gradients are still the parameters' `.grad` when the forward runs; after
    one plain forward the backward hands them out as copies and both graphs replay,
    with losses and weights equal to eager's step after step."""
    torch.manual_seed(0)
    model, ref = TrainBlock().cuda(), TrainBlock().cuda()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="rewritec", mode="reduce-overhead")
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, ref)]
    report.reset()
    for _ in range(6):
        x = torch.randn(8, 16, 64, device="cuda")
        losses = []
        for fn, opt in ((compiled, opts[0]), (ref, opts[1])):
            loss = fn(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-4)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
    decided = [r.cudagraphs for r in report.RECORDS if r.kind in ("forward", "backward")]
    assert decided and all("recorded" in d for d in decided), decided
    assert any("of a later graph held" in d for d in decided), decided


@cuda
def test_reduce_overhead_two_forwards_before_one_backward_match_eager() -> None:
    """Gradient accumulation: two micro-batches' forwards, then one backward of their
    sum. The first forward's activations, over the graph's memory, are still held
    while the second runs plainly and its backward is recorded; every step's
    gradients equal eager's."""
    torch.manual_seed(0)
    model, ref = TrainBlock().cuda(), TrainBlock().cuda()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="rewritec", mode="reduce-overhead")
    for _ in range(6):
        xs = [torch.randn(8, 16, 64, device="cuda") for _ in range(2)]
        grads = []
        for m, fn in ((model, compiled), (ref, ref)):
            m.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
            a = fn(xs[0]).pow(2).mean()
            b = fn(xs[1]).pow(2).mean()
            (a + b).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        for g, e in zip(*grads, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_training_graphs_may_write_their_inputs_where_they_are() -> None:
    """A forward graph updating a buffer (BatchNorm's running mean) is eligible for
    replay, which writes where the buffer is; anything else mutable is not."""
    from rewritec.runtime.cudagraphs import mutated_inputs

    gm = _graph(lambda x, buf: (buf.copy_(buf * 0.9 + x.mean(0) * 0.1), x * 2)[1],
                torch.randn(4, 8), torch.randn(8))
    writes = mutated_inputs(gm)
    assert sorted(writes.values()) == [1]
    assert eligible(gm, "forward", aliased_outputs=False, training=True) is None
    assert eligible(gm, "inference", aliased_outputs=False) is not None
    assert eligible(gm, "forward", aliased_outputs=False) is not None  # auto: no training
    noisy = _graph(lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[0], torch.randn(4))
    assert eligible(noisy, "forward", aliased_outputs=False, training=True) is None
    assert eligible(noisy, "forward", aliased_outputs=False) is not None


class ConvBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@cuda
def test_reduce_overhead_training_updates_running_statistics_once_per_step() -> None:
    torch.manual_seed(0)
    model, ref = ConvBN().cuda(), ConvBN().cuda()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="rewritec", mode="reduce-overhead")
    report.reset()
    for _ in range(5):
        x = torch.randn(4, 3, 8, 8, device="cuda")
        for m, fn in ((model, compiled), (ref, ref)):
            m.zero_grad(set_to_none=True)
            fn(x).square().mean().backward()
        for g, e in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(g.grad, e.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
        torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)
    forward = [r.cudagraphs for r in report.RECORDS if r.kind == "forward"]
    assert forward and all("recorded" in d for d in forward), forward


class Awkward(torch.nn.Module):
    """What a replay cannot take: an input written in place, an output that is a
    view of an input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, state: torch.Tensor):
        state.add_(1.0)
        y = torch.tanh(self.fc(x)) * state
        return y, x.view(-1)


@cuda
@pytest.mark.parametrize("dynamic", [False, True])
def test_reduce_overhead_runs_what_it_cannot_replay_plainly(dynamic: bool) -> None:
    """An input mutated in place, an output aliasing an input and dynamic shapes:
    results, gradients and the mutated input equal eager's, step after step."""
    torch.manual_seed(0)
    model, ref = Awkward().cuda(), Awkward().cuda()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="rewritec", mode="reduce-overhead",
                             dynamic=dynamic)
    s1, s2 = torch.zeros(16, device="cuda"), torch.zeros(16, device="cuda")
    for n in (4, 4, 4, 6, 6, 6):
        x = torch.randn(n, 16, device="cuda", requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y, view = compiled(x, s1)
        y_ref, view_ref = ref(x2, s2)
        (y.sum() + view.sum()).backward()
        (y_ref.sum() + view_ref.sum()).backward()
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(view, view_ref)
        torch.testing.assert_close(s1, s2)
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)


@cuda
def test_a_capture_cuda_invalidates_leaves_random_numbers_and_memory_working() -> None:
    """A graph whose capture CUDA invalidates (a copy to the host inside it) after a
    random op: the runner runs it plainly from then on, and random numbers and
    allocations work afterwards as before (they failed once a capture died)."""
    def fn(args: list[torch.Tensor]) -> torch.Tensor:
        x = args[0]
        noise = torch.rand_like(x)
        scale = float(x.abs().max().cpu())  # synchronises: invalid inside a capture
        return x * scale + noise * 0

    runner = CudaGraphRunner(fn, [False], "on")
    x = torch.randn(64, device="cuda")
    want = x * x.abs().max()
    for _ in range(3):  # plain, then the capture that fails, then plain
        torch.testing.assert_close(runner([x]), want)
    assert runner.disabled is not None and "capture failed" in runner.disabled
    torch.manual_seed(3)
    a = torch.rand(1000, device="cuda")
    torch.manual_seed(3)
    torch.testing.assert_close(torch.rand(1000, device="cuda"), a)
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # plain allocator again
    del big
    torch.cuda.synchronize()


class DropBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.relu(self.fc(x)), 0.5, training=True) + 1.0


@cuda
def test_dropout_in_training_is_replayed_with_fresh_masks() -> None:
    """mode="reduce-overhead" replays a training graph with dropout: each step draws
    a new mask (about half the values dropped, never the previous step's mask), the
    input's gradient uses the very mask of its step's output, and
    `torch.manual_seed` before a step decides its mask as it does for replays."""
    torch.manual_seed(0)
    model = DropBlock().cuda()
    compiled = torch.compile(model, backend="rewritec", mode="reduce-overhead")
    report.reset()
    x = torch.randn(64, 64, device="cuda").abs() + 0.1
    masks, seeded = [], {}
    for step in range(8):
        if step in (4, 6):
            torch.manual_seed(123)
        xg = x.clone().requires_grad_()
        y = compiled(xg)
        h = torch.relu(model.fc(x))
        kept = (y - 1.0) != 0
        torch.testing.assert_close(torch.where(kept, y - 1.0, 0.0),
                                   torch.where(kept, h * 2.0, 0.0), rtol=1e-4, atol=1e-4)
        y.sum().backward()
        # d(sum)/dx = W^T (mask * 2 * relu'(fc x)): recompute it with this step's mask
        want = ((kept & (h > 0)).float() * 2.0) @ model.fc.weight
        torch.testing.assert_close(xg.grad, want, rtol=1e-4, atol=1e-4)
        assert 0.35 < kept[h > 0].float().mean().item() < 0.65  # relu's zeros aside
        if masks:
            assert not torch.equal(kept, masks[-1])
        masks.append(kept)
        if step in (4, 6):
            seeded[step] = kept
        model.zero_grad(set_to_none=True)
    assert torch.equal(seeded[4], seeded[6])
    decided = [r.cudagraphs for r in report.RECORDS if r.kind in ("forward", "backward")]
    assert decided and all("recorded" in d for d in decided), decided


@cuda
def test_a_copy_from_a_host_constant_is_replayed() -> None:
    """T5's shift-right writes a 0-dim CPU constant into a GPU tensor; the wrapper
    copies the constant to the device once, so the graph can be recorded."""
    def shift_right(ids: torch.Tensor) -> torch.Tensor:
        out = ids.new_zeros(ids.shape)
        out[..., 1:] = ids[..., :-1].clone()
        out[..., 0] = torch.tensor(7)
        return out * 2

    compiled = rewritec.compile(shift_right, cudagraphs="on", strict=True)
    for _ in range(4):
        ids = torch.randint(100, (3, 9), device="cuda")
        torch.testing.assert_close(compiled(ids), shift_right(ids))
    assert any("recorded" in r.cudagraphs for r in report.RECORDS), \
        [r.cudagraphs for r in report.RECORDS]
