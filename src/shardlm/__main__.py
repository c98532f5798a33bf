import sys

from shardlm.cli import main


def _main() -> int | str | None:
    try:
        return main()
    except SystemExit as stop:
        return stop.code
    except Exception:
        launch = sys.modules.get("shardlm.launch")
        if launch is None or not launch.joined_group():
            raise
        sys.excepthook(*sys.exc_info())  # the traceback an uncaught exception prints
        return 1


code = _main()
if "shardlm.launch" in sys.modules:  # a rank that joined a process group ends there (issue 25)
    sys.modules["shardlm.launch"].end_process(code)
sys.exit(code)
