"""The server's processes take their startup objects out of the garbage collector's
passes (runtime.process.freeze_startup_objects), so a full collection while serving
walks only what serving made."""

import subprocess
import sys

CHILD = r"""
import gc
from plait.runtime.process import freeze_startup_objects
startup = [[i] for i in range(300_000)]  # a loaded model's worth of tracked objects
before = len(gc.get_objects())
frozen = freeze_startup_objects()
after = len(gc.get_objects())
gc.collect()
assert frozen >= 300_000, frozen
assert before >= 300_000 and after < 50_000, (before, after)
assert all(x[0] == i for i, x in enumerate(startup))  # frozen, not freed
print("ok", frozen, after)
"""


def test_freeze_startup_objects_takes_them_out_of_collections():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")


def test_engine_process_and_front_freeze_before_serving():
    """Both the engine process and the front call it once started, before their first
    request (before EngineReady; before the ready report)."""
    import inspect

    from plait.runtime.server import engine_proc, serve

    main = inspect.getsource(engine_proc.main)
    assert main.index("freeze_startup_objects()") < main.index("P.EngineReady(")
    body = inspect.getsource(serve._serve)
    assert body.index("freeze_startup_objects()") < body.index("report({")
