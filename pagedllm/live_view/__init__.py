"""The live view: step records from the engine core, kept by the front end, shown at /dashboard.

``records`` (msgspec structs on the output channel), ``recorder`` (engine-core side, only when
enabled), ``block_map`` (replays block operations into the pool's state), ``view`` (the
front end's ring buffer and request lifecycles), ``trace`` (Chrome Trace Event export),
``routes`` (the page, its event stream and /debug/trace) and ``static/`` (the page itself).
"""
