"""Records every file a DVC stage opens for reading, for the end-to-end test's check of
each stage's reads against its dvc.yaml deps.

Python imports `sitecustomize` at start-up from any folder on PYTHONPATH; the end-to-end
test puts this folder there and names a log in RLHF_TRACE_READS. Only processes that DVC
runs as a stage (DVC sets DVC_STAGE) record, through an audit hook on `open` (Python's
`open` and `os.open`), one line per read: the stage address, a tab, the absolute path.
Parquet tables are opened through Python (rlhf.data.prepared.read_prepared) and model
folders through their config.json, so both show here.
"""

import os
import sys

_LOG = os.environ.get("RLHF_TRACE_READS")
_STAGE = os.environ.get("DVC_STAGE")

if _LOG and _STAGE:
    # Opened before the hook exists; os.write raises no audit event, so the hook cannot
    # recurse into itself.
    _FD = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR

    def _record_reads(event, args):
        if event != "open":
            return
        path, mode, flags = args
        if isinstance(path, int):
            return
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
        if not writing:
            os.write(_FD, f"{_STAGE}\t{os.path.abspath(os.fsdecode(path))}\n".encode())

    sys.addaudithook(_record_reads)
