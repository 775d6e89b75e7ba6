"""The TorchDynamo backend `rewritec` (registered through the
`torch_dynamo_backends` entry point, so `torch.compile(m, backend="rewritec")`
works without importing rewritec first).

Dynamo hands over a torch-level FX graph; AOTAutograd traces it to ATen and
splits forward and backward, and each half is compiled by `compiler.compile_fx`.
An inference graph compiled before is loaded from the graph cache instead
(runtime/graph_cache.py), without AOTAutograd.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch

from ..runtime import ahead, triton_startup
from ..engine.errors import RewritecError
from ..options import Options
from ..runtime import graph_cache
from ..runtime.cudagraphs import Pool


# torch.compile looks the backend up (importing this module) before TorchDynamo
# traces: in a process that already uses CUDA, the compile worker starts now and is
# ready by the time a graph's kernels are rendered (runtime/ahead.py).
if torch.cuda.is_initialized():
    ahead.start()


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _is_buffer(node: torch.fx.Node) -> bool:
    """A module buffer lifted to a graph input (running_mean, ...): Dynamo's
    source for it reads `..._buffers['name']`."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return source is not None and "._buffers[" in source.name


def check_options(opts: Options) -> None:
    """Rule names in `disable` that name no rule are an error as soon as the options
    are given. The rule library is imported only then, so that a graph-cache load
    imports no rule engine (tests/test_graph_cache.py)."""
    if opts.disable:
        from ..rulesets import check_disabled  # see the docstring

        check_disabled(opts)


def rewritec_backend(gm: torch.fx.GraphModule, example_inputs: list[Any],
                     options: dict[str, Any] | None = None, mode: str | None = None) -> Any:
    if mode is not None and options and options.get("mode", mode) != mode:
        raise RewritecError(f"mode={mode!r} and options={{'mode': {options['mode']!r}}} "
                            "disagree; give one")
    opts = Options.make(options, **({} if mode is None else {"mode": mode}))
    check_options(opts)  # torch.compile(backend="rewritec", options=...) gets here first
    # Parameters and buffers arrive as graph inputs; remember which, for folding
    # in inference graphs (aten/fold.py guards that against later updates).
    params = [isinstance(x, torch.nn.Parameter) or _is_buffer(n)
              for x, n in zip(example_inputs, _placeholders(gm), strict=False)]
    key = graph_cache.key_for(gm, example_inputs, params, opts)
    if key is not None:
        def recompile(args: list[Any], freeze: bool) -> Any:
            again = replace(opts, graph_cache=False, freeze=opts.freeze if freeze else False)
            return _through_aot(gm, args, again, params, None)

        hit = graph_cache.load(key, example_inputs, params, opts, recompile)
        if hit is not None:
            return hit  # its kernels launch binaries stored before, without Triton's JIT
    if opts.target in ("auto", "triton") and any(
            isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
        if ahead.start():
            triton_startup.defer()  # the worker compiles; Triton starts here only if needed
        else:
            triton_startup.start()  # overlaps Triton's own start-up with tracing
    return _through_aot(gm, example_inputs, opts, params, key)


def _through_aot(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options,
                 params: list[bool], key: str | None) -> Any:
    """AOTAutograd traces `gm` to ATen (forward and backward, or inference) and
    compiler.compile_fx compiles each graph; an inference graph that AOTAutograd
    passes through unchanged is stored in the graph cache under `key`."""
    # the compile side, here: a graph-cache hit (rewritec_backend) loads without it
    from ..compiler import compile_fx
    from .attention_masks import contiguous_attention_masks
    from .decompositions import decomposition_table, kept_whole
    from .saved_layouts import follow_saved_layouts

    # torch's fused attention kernels, not its math path (frontend/attention_masks.py)
    contiguous_attention_masks(gm)
    # Emptied once AOTAutograd has compiled: torch keeps its compilers (and so what
    # they close over) for as long as the compiled function lives, and these are the
    # first call's tensors (on torch 2.11, a GPT-2 training step kept the first
    # step's 393 MB of logits, the example input of the loss graph after its break).
    values = list(example_inputs)
    returned = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    n_outputs = len(returned) if isinstance(returned, tuple | list) else 1

    # The CUDA graphs of this graph's forward and backward share their memory
    # (runtime/cudagraphs.py: Pool)
    pool = None
    if opts.cudagraphs == "on" and torch.cuda.is_available():
        pool = Pool()

    def forward(fw_gm: torch.fx.GraphModule, fw_inputs: list[Any]) -> Any:
        return compile_fx(fw_gm, fw_inputs, opts, kind="forward", params=params, pool=pool)

    def inference(fw_gm: torch.fx.GraphModule, fw_inputs: list[Any]) -> Any:
        # Inference graphs (no grad) may fold parameters: aten/fold.py says when.
        aligned = len(fw_inputs) == len(values)
        keep = None
        if key is not None and graph_cache.aot_passes_through(fw_gm, len(values), n_outputs):
            keep = partial(graph_cache.save, key)
        return compile_fx(fw_gm, fw_inputs, opts, kind="inference", params=params,
                          param_values=values if aligned else None, keep=keep)

    def backward(bw_gm: torch.fx.GraphModule, bw_inputs: list[Any]) -> Any:
        # saved activations may come in the forward's layouts (frontend/saved_layouts.py)
        follow_saved_layouts(bw_gm, bw_inputs)
        return compile_fx(bw_gm, bw_inputs, opts, kind="backward", pool=pool)

    # Updates of inputs that need no gradient (BatchNorm's running statistics) stay
    # in the graph, which writes them in one call (aten/input_writes.py) instead of
    # AOTAutograd's runtime copying each from Python after it.
    compilers = {"fw_compiler": forward, "bw_compiler": backward,
                 "inference_compiler": inference,
                 "decompositions": decomposition_table(kept_whole(opts), _training(values)),
                 "partition_fn": _partition, "keep_inference_input_mutations": True}
    try:
        if any(isinstance(x, list | tuple | dict) for x in example_inputs):
            # nested inputs: torch's helper flattens them first
            from torch._dynamo.backends.common import aot_autograd

            return aot_autograd(**compilers)(gm, example_inputs)
        return _aot(gm, example_inputs, compilers)
    finally:
        values.clear()


def _training(inputs: list[Any]) -> bool:
    """Will AOTAutograd trace a joint forward+backward graph? (as it decides)"""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def _partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
    """How the joint forward+backward graph is split: AOTAutograd's min-cut
    rematerialization partitioner (Inductor's), which saves fewer activations for the
    backward and recomputes cheap pointwise work there instead, where the fuse rules
    fold it into the backward's kernels. Its default partitioner saves every
    intermediate the backward reads: GPT-2's training step held 1.5x Inductor's peak
    memory with it."""
    from torch._functorch import config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    unread_running_stats(joint)
    # Its CSE pass imports Inductor's pattern matcher and lowerings (a second of a
    # cold compile); the rule engine's terms are hash-consed, which is CSE already.
    with config.patch(cse=False):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


BN_BACKWARD = "native_batch_norm_backward"


def unread_running_stats(joint: torch.fx.GraphModule) -> None:
    """Pass None for the running mean and variance of every batch-norm backward in
    training in a joint graph: it reads the saved batch statistics then, never the
    running ones (its schema takes them optional). Otherwise the partitioner saves
    the forward's updated statistics (two tensors a batch norm) for a backward that
    never reads them, and the forward must hand them out besides writing them into
    the buffers (aten/input_writes.py)."""
    changed = False
    for node in joint.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "").startswith(
                BN_BACKWARD + ".") and len(node.args) >= 8 and node.args[7] is True \
                and (node.args[3] is not None or node.args[4] is not None):
            node.args = (*node.args[:3], None, None, *node.args[5:])
            changed = True
    if changed:
        joint.recompile()


def _aot(gm: torch.fx.GraphModule, example_inputs: list[Any], compilers: dict[str, Any]) -> Any:
    """What torch's `aot_autograd(...)` backend helper does for flat inputs, less
    its import of torch._inductor.debug (for AOT logging), which is 0.05 s of a cold
    compile on the CPU machine: TorchDynamo stays out of the backward compiler, the
    backward graph it returns and the compiled graph."""
    from torch._dynamo import disable
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import aot_module_simplified

    # Counted as torch's helper counts it: Dynamo's DDPOptimizer reads the count to
    # see that AOTAutograd compiled a bucket's graph, whose first call it then makes
    # on fake tensors; uncounted, the first real step returned FakeTensors.
    counters["aot_autograd"]["total"] += 1
    backward = compilers["bw_compiler"]

    def bw_compiler(*args: Any, **kwargs: Any) -> Any:
        return disable(disable(backward)(*args, **kwargs))

    compiled = aot_module_simplified(gm, example_inputs, **{**compilers,
                                                            "bw_compiler": bw_compiler})
    return disable(compiled)
