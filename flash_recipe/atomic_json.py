"""Writing a JSON document so that a reader never sees half of it."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Union


def write_json(path: Union[str, os.PathLike], document: Any) -> None:
    """Write ``document`` as indented JSON to ``path`` atomically: into a temporary file beside it,
    then renamed over it, so a concurrent reader (a tuner's cache, a campaign's partial report)
    sees the old file or the new one. The temporary file is removed if writing fails."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
