"""The HTML compile report: one self-contained page per artifact folder.

    collect.py  at compile time (out_dir only): a graph's nodes, rule firings,
                fallback reasons -> <graph>.details.json beside report.json
    layout.py   graph pictures: Graphviz `dot` lays out SVG, a page of nodes at a time
    page.py     report.json + the details files -> report.html (`rewritec report DIR`)
"""
