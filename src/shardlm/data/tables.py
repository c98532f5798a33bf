"""Arrow and Parquet sources, streamed a bounded number of rows at a time.

data.source (and data.val_source) may name, beside text and JSONL files:
  - a `datasets` save_to_disk directory: state.json / dataset_info.json and data-*.arrow files
    (Arrow IPC streams), read memory-mapped, record batch by record batch;
  - a DatasetDict saved the same way (dataset_dict.json and one such directory per split): its
    'train' split as data.source, its 'validation' (else 'test') split as data.val_source; or
    name the split's directory itself;
  - Parquet: a .parquet file, a directory of them, or a glob ('shards/*.parquet'), read with
    ParquetFile.iter_batches over only the columns needed.
Rows become Python values ROWS_PER_BATCH at a time, so memory holds one Parquet row group or one
memory-mapped Arrow batch plus that many rows, never the whole table. The columns are named by
config: data.jsonl_field for text, 'messages' / 'prompt' + 'completion' for the SFT formats
(renamed by data.columns). pyarrow is an optional dependency (`pip install 'shardlm[data]'`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from shardlm.errors import ConfigError

TABLE_SUFFIXES = (".parquet", ".arrow")
ROWS_PER_BATCH = 256
"""Rows turned into Python objects at once (and Parquet's iter_batches batch size)."""
SPLITS = {"train": ("train",), "val": ("validation", "test")}
"""A DatasetDict's split read for data.source ('train') and data.val_source ('val'), by preference."""


def pyarrow():
    """The pyarrow module, or a ConfigError saying how to install it."""
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401  (submodules used below)
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError("reading Arrow / Parquet data (a datasets save_to_disk directory or "
                          ".parquet files) needs pyarrow: pip install 'shardlm[data]' (or "
                          "pip install 'pyarrow>=14')") from None
    return pa


def is_dataset_dir(path: Path) -> bool:
    """A directory written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return any((path / name).is_file() for name in ("dataset_dict.json", "state.json", "dataset_info.json"))


def dataset_dir_files(path: Path, split: str = "train") -> list[Path]:
    """The .arrow files of a save_to_disk directory in their order (state.json's), or of the
    chosen split of a DatasetDict (`split`: 'train' or 'val', SPLITS)."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        chosen = next((s for s in SPLITS[split] if s in splits), None)
        if chosen is None:
            role = "data.source" if split == "train" else "data.val_source"
            raise ConfigError(f"{role} {str(path)!r} is a DatasetDict with splits {splits}, none of "
                              f"{list(SPLITS[split])}; name a split's directory instead, e.g. "
                              f"{str(path / splits[0]) if splits else str(path / 'train')!r}")
        return dataset_dir_files(path / chosen, split)
    state = path / "state.json"
    if state.is_file():
        files = [path / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    else:
        files = sorted(path.glob("data-*.arrow"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise ConfigError(f"save_to_disk directory {str(path)!r}: "
                          + (f"missing {missing}" if missing else "no data-*.arrow files"))
    return files


def _check_columns(path: Path, present: list[str], wanted: list[str], hint: str) -> None:
    for name in wanted:
        if name not in present:
            raise ConfigError(f"{path}: no column {name!r} (columns: {present}); {hint}")


def iter_rows(path: Path, columns: list[str], hint: str = "",
              rows: int = ROWS_PER_BATCH) -> Iterator[dict]:
    """Each row of an Arrow / Parquet file as {column: value} over `columns` only, in order,
    `rows` rows converted at a time. A missing column is a ConfigError naming it, the columns
    present and `hint` (which config key names it)."""
    pa = pyarrow()
    if path.name.endswith(".parquet"):
        # pre_buffer=False: its default (True) reads every row group's bytes up front, the whole
        # file (measured: tests/test_eval_data.py); without it, one row group at a time.
        reader = pa.parquet.ParquetFile(path, pre_buffer=False)
        _check_columns(path, reader.schema_arrow.names, columns, hint)
        for batch in reader.iter_batches(batch_size=rows, columns=columns):
            yield from batch.to_pylist()
        return
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)  # what save_to_disk writes
        except pa.ArrowInvalid:
            source.seek(0)
            file = pa.ipc.open_file(source)  # the Arrow IPC file format ("Feather v2")
            reader = (file.get_batch(i) for i in range(file.num_record_batches))
            schema = file.schema
        else:
            schema = reader.schema
        _check_columns(path, schema.names, columns, hint)
        for batch in reader:  # memory-mapped: a batch's pages are read as rows are converted
            batch = batch.select(columns)
            for start in range(0, batch.num_rows, rows):
                yield from batch.slice(start, rows).to_pylist()
