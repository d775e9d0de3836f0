"""The one writer of benchmark result files: JSON with each record on one line when it fits.

A dict or list is written on one line when its compact form is at most `WIDTH` characters, or at
most `FLAT_WIDTH` when it holds no nested dict or list (a record of scalars reads whole); larger
ones are nested, one entry a line, indented by one space. `json.loads` of the text gives `obj` back.

    from bench.results import write_result
    write_result(args.out, result)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

WIDTH = 300
FLAT_WIDTH = 400


def _flat(v: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> bool:
    return not any(isinstance(x, dict | list | tuple) for x in (v.values() if isinstance(v, dict) else v))


def _key(k: Any) -> str:
    # json.dumps's rule for non-string keys: their JSON text (True -> "true", 1 -> "1").
    return json.dumps(k if isinstance(k, str) else json.dumps(k), ensure_ascii=False)


def _encode(v: Any, level: int, default: Callable[[Any], Any] | None) -> str:
    compact = json.dumps(v, ensure_ascii=False, default=default)
    if not isinstance(v, dict | list | tuple) or not v:
        return compact
    if level > 0 and (len(compact) <= WIDTH or (len(compact) <= FLAT_WIDTH and _flat(v))):
        return compact
    inner = " " * (level + 1)
    if isinstance(v, dict):
        items = [f"{inner}{_key(k)}: {_encode(x, level + 1, default)}" for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    return "[\n" + ",\n".join(inner + _encode(x, level + 1, default) for x in v) + "\n" + " " * level + "]"


def dumps(obj: Any, default: Callable[[Any], Any] | None = None) -> str:
    """The result file's text (ends with a newline); `default` as json.dumps takes it."""
    return _encode(obj, 0, default) + "\n"


def errors(node: Any, where: str = "") -> list[str]:
    """Every "error" entry anywhere in a result (a phase that failed records its traceback there),
    each as "<path>: <the error's last 1500 characters>"."""
    if isinstance(node, dict):
        found = [f"{where}: {str(node['error'])[-1500:]}"] if "error" in node else []
        for k, v in node.items():
            found += errors(v, f"{where}/{k}")
        return found
    return []


def write_result(path: str | Path, obj: Any, default: Callable[[Any], Any] | None = None) -> Path:
    """Write `obj` to `path` (parents created) as dumps gives it; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dumps(obj, default))
    return p
