"""README.md is the page a user reads: its syncer flag table lists exactly the parser's flags with their defaults,
its links resolve, it keeps the two commands and stays short (the evidence lives in docs/)."""
import os
import re

from yeto_patch.syncer.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def flag_rows(text):
    start = text.index("| flag | default | meaning |")
    rows = {}
    for line in text[start:].split("\n")[2:]:
        if not line.startswith("| `--"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1]
    return rows


def test_syncer_flag_table_matches_the_parser():
    rows = flag_rows(readme())
    actions = {a.option_strings[-1]: a for a in build_parser()._actions
               if a.option_strings and a.option_strings[-1] != "--help"}
    assert set(rows) == set(actions), (sorted(set(actions) - set(rows)), sorted(set(rows) - set(actions)))
    for flag, action in actions.items():
        if action.default not in (None, False):   # the table states the parser's default
            assert rows[flag].startswith(f"`{action.default}`"), (flag, rows[flag], action.default)
        elif action.default is False:
            assert rows[flag] == "off", flag


def test_commands_links_and_size():
    text = readme()
    assert "\n    bash scripts/demo.sh\n" in text and "\n    bash scripts/test.sh\n" in text
    assert len(text.encode()) < 14 * 1024, len(text.encode())   # (aim: 12 KB; the evidence lives in docs/)
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert os.path.exists(os.path.join(ROOT, target)), target
    for doc, anchor in re.findall(r"\]\((docs/[^)#]+)#([^)]*)\)", text):
        with open(os.path.join(ROOT, doc)) as f:
            headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                        for h in re.findall(r"^#+ (.*)$", f.read(), re.M)}
        assert anchor in headings, (doc, anchor)
