"""Every `rewritec::*` op, defined by importing this module: attention
(aten/attention.py), iota (aten/iota.py) and take (aten/take.py). Code that may meet
one of them in a graph it did not build (a bridge resolving an op name, the graph
cache unpickling a graph, a package's program) imports this, so that a new op is
added in one place."""

from . import attention, iota, take  # noqa: F401 - each defines its op on import
