"""Fusion coverage: how much of a graph's own work runs inside generated kernels.

`report.py` gives each compiled graph a `coverage` entry (docs/report.md) from
two counts the compiler already keeps: the ops each kernel computes
(`kernels[].ops`, op-table names) and the ops the wrapper still runs through
ATen (`fallback_ops`, ATen overload packets). Every op is put in one of three
classes, here and nowhere else:

- `extern`: a library call that rewritec does not try to generate (matrix
  products, convolutions, attention, FFT, linear algebra, recurrent cells,
  collectives);
- `no_kernel`: an op that launches no kernel (views, metadata, allocation,
  size arithmetic on the host);
- `counted`: everything else, the work a generated kernel could do (pointwise
  ops and casts, copies, reductions, normalizations, gathers and scatters,
  fills, scans, their backwards).

share = counted ops inside kernels / all counted ops; `extern` and `no_kernel`
ops are left out of both sides, wherever they run (an mm or a reshape inside a
matmul kernel adds nothing to the numerator).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .engine.ops import OpTable, default_op_table

OpClass = Literal["counted", "extern", "no_kernel"]

# Library calls of ATen (and other namespaces) that are not in the op table; an op
# that is in it is classed by its `category` (rules/ops.yaml: extern | view).
EXTERN_OPS = frozenset({
    # matrix products
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot",
    "vdot", "einsum", "_addmm_activation", "_int_mm", "_scaled_mm",
    # attention, and the fused transformer layers of nn.Transformer's fast path
    "scaled_dot_product_attention", "rewritec::attention", "_native_multi_head_attention",
    "_transformer_encoder_layer_fwd",
    # linear algebra
    "cholesky", "triangular_solve",
    # recurrent cells
    "lstm", "gru", "rnn_tanh", "rnn_relu", "_cudnn_rnn", "_cudnn_rnn_backward", "miopen_rnn",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
})
EXTERN_PREFIXES = (
    # convolution, convolution_backward, conv2d, conv_transpose2d, _convolution, and
    # the backends ATen hands them to
    "conv", "_convolution", "cudnn_convolution", "mkldnn_convolution", "miopen_convolution",
    "_slow_conv", "slow_conv", "thnn_conv", "_nnpack_spatial_convolution",
    # every SDPA flavour and its backward
    "_scaled_dot_product_", "_efficient_attention", "_flash_attention", "_cudnn_attention",
    "_fft_", "fft_", "linalg_", "_linalg_",
    "_c10d_functional::", "_c10d_functional_autograd::", "c10d::",
)
# Extern in the op table only because no template computes it yet: batch_norm_eval
# is pointwise work (a scale and a shift per channel) that rules decompose; it counts.
COUNTED_DESPITE_TABLE = frozenset({"batch_norm_eval", "_native_batch_norm_legit_no_training"})

# ATen ops outside the op table that launch no kernel: views (also when ATen's
# reshape has to copy, the op table's `reshape` is a view), metadata, allocation
# without a fill, and asserts.
NO_KERNEL_OPS = frozenset({
    "getitem", "_reshape_alias", "view_as", "expand_as", "split", "split_with_sizes", "unbind",
    "chunk", "narrow", "detach", "as_strided", "diagonal", "movedim", "swapaxes", "unfold",
    "view_as_real", "view_as_complex", "real", "imag", "_conj", "_neg_view", "lift_fresh",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_local_scalar_dense",
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
    "_assert_async", "_assert_scalar", "_assert_tensor_metadata", "_functional_assert_async",
    "sym_constrain_range", "sym_constrain_range_for_size",
})
# Python callables in a graph (runtime/wrapper.py: callable_label): size arithmetic on
# SymInts and grad-mode switches run on the host.
NO_KERNEL_PREFIXES = ("operator.", "builtins.", "math.", "torch.sym_", "torch._sym_",
                      "torch._C._set_grad_enabled")

_TABLE_CLASS = {"extern": "extern", "view": "no_kernel"}
_by_name: tuple[OpTable, dict[str, str]] | None = None


def _table_categories() -> dict[str, str]:
    """Op-table category by op-table name and by the ATen overload packet it calls."""
    global _by_name
    table = default_op_table()
    if _by_name is None or _by_name[0] is not table:
        names: dict[str, str] = {}
        for op in table.ops.values():
            for overload, _ in op.overloads():
                names.setdefault(overload.rsplit(".", 1)[0], op.category)
        names.update({name: op.category for name, op in table.ops.items()})
        _by_name = (table, names)
    return _by_name[1]


def op_class(name: str) -> OpClass:
    """The class of an op named as in `fallback_ops` (an ATen overload packet,
    `ns::name`, a Python callable's qualified name) or `kernels[].ops` (op-table name)."""
    if name in COUNTED_DESPITE_TABLE:
        return "counted"
    category = _table_categories().get(name)
    if category is not None:
        return "extern" if category == "extern" else "no_kernel" if category == "view" \
            else "counted"
    if name in EXTERN_OPS or name.startswith(EXTERN_PREFIXES):
        return "extern"
    if name in NO_KERNEL_OPS or name.startswith(NO_KERNEL_PREFIXES):
        return "no_kernel"
    return "counted"


@dataclass(frozen=True)
class Coverage:
    """The counted ops of one graph (or several, added up): how many run inside
    generated kernels, and which run outside, by name; and how many were left out."""

    in_kernels: int = 0
    outside_ops: Mapping[str, int] = field(default_factory=dict)
    extern: int = 0
    no_kernel: int = 0

    @property
    def outside(self) -> int:
        return sum(self.outside_ops.values())

    @property
    def share(self) -> float | None:
        """in_kernels / all counted ops; None for a graph with no counted op."""
        total = self.in_kernels + self.outside
        return self.in_kernels / total if total else None

    def __add__(self, other: Coverage) -> Coverage:
        return Coverage(self.in_kernels + other.in_kernels,
                        dict(Counter(self.outside_ops) + Counter(other.outside_ops)),
                        self.extern + other.extern, self.no_kernel + other.no_kernel)

    def to_json(self) -> dict[str, Any]:
        share = self.share
        return {"share": None if share is None else round(share, 4),
                "in_kernels": self.in_kernels, "outside": self.outside,
                "outside_ops": dict(Counter(self.outside_ops).most_common()),
                "excluded": {"extern": self.extern, "no_kernel": self.no_kernel}}


def measure(kernel_ops: Iterable[Mapping[str, int]], fallback_ops: Mapping[str, int]
            ) -> Coverage:
    """The coverage of a graph whose kernels compute `kernel_ops` (one mapping per
    kernel) and whose wrapper runs `fallback_ops` through ATen."""
    excluded: Counter[str] = Counter()
    in_kernels = 0
    for ops in kernel_ops:
        for name, n in ops.items():
            cls = op_class(name)
            if cls == "counted":
                in_kernels += n
            else:
                excluded[cls] += n
    outside: Counter[str] = Counter()
    for name, n in fallback_ops.items():
        cls = op_class(name)
        if cls == "counted":
            outside[name] += n
        else:
            excluded[cls] += n
    return Coverage(in_kernels, dict(outside), excluded["extern"], excluded["no_kernel"])


def top_outside(cov: Coverage, n: int) -> str:
    """The `n` commonest ops outside kernels, `op xN, ...` ("+K more" after them)."""
    ops = Counter(cov.outside_ops).most_common()
    text = ", ".join(f"{op} x{c}" for op, c in ops[:n])
    return text + (f", +{len(ops) - n} more" if len(ops) > n else "")
