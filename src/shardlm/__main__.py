import os
import sys

from shardlm.cli.main import main

SIGPIPE_STATUS = 141
"""What a shell reports for a command its reader stopped reading (128 + SIGPIPE)."""


def _main() -> int | str | None:
    try:
        code = main()
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not in finalisation
        return code
    except SystemExit as stop:
        return stop.code
    except BrokenPipeError:  # `shardlm presets | head`: the reader has what it wanted
        # Later writes (the interpreter's final flush) go nowhere instead of failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_STATUS
    except Exception:
        launch = sys.modules.get("shardlm.launch.runtime")
        if launch is None or not launch.joined_group():
            raise
        sys.excepthook(*sys.exc_info())  # the traceback an uncaught exception prints
        return 1


def run() -> None:
    """The `shardlm` command and `python -m shardlm`: a rank that joined a process group ends
    through launch.end_process (issue 25: no interpreter finalisation racing gloo's threads),
    whichever way it was started (torchrun running either, `shardlm train --nproc N`)."""
    code = _main()
    if "shardlm.launch.runtime" in sys.modules:
        sys.modules["shardlm.launch.runtime"].end_process(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
