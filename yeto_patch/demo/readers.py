"""Incremental readers for the JSONL files the demo's processes write (tolerant of a half-written last line)."""
import json
import os

__all__ = ["JsonlTail", "read_jsonl"]


class JsonlTail:
    """Reads the complete lines appended to a JSONL file since the last call."""

    def __init__(self, path):
        self.path, self.offset, self.records = path, 0, []

    def poll(self):
        new = []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return new
        end = data.rfind(b"\n")
        if end < 0:
            return new
        self.offset += end + 1
        for line in data[: end + 1].splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                new.append(rec)
        self.records.extend(new)
        return new


def read_jsonl(path):
    if not path or not os.path.exists(path):
        return []
    t = JsonlTail(path)
    t.poll()
    return t.records
