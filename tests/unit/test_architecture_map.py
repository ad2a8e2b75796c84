"""docs/architecture.md cannot name a module that is not there.

The "Module map of one PD request" section lists, numbered in the order a request meets them,
the modules a newcomer reads to trace one PD request, each as a repository path
(`pdserve/worker/loop.py`). Every numbered entry must be a real file, named once, numbered 1..N
with no gap, and the count the section states must be N. Every `pdserve/...` path anywhere in
the page, and the shorter `worker/loop.py` / `loop.py` / `disagg/kv_sender.PrefillSender` forms the
rest of the page uses, must name a file in the tree as well.
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOC = os.path.join(ROOT, "docs", "architecture.md")
MAP_HEADING = "## Module map of one PD request"
PACKAGES = sorted(d for d in os.listdir(os.path.join(ROOT, "pdserve"))
                  if os.path.isdir(os.path.join(ROOT, "pdserve", d)) and not d.startswith("_"))

ENTRY = re.compile(r"^(\d+)\. `([^`]+)`")  # "12. `pdserve/server/tokenizer.py`: ..."
COUNT = re.compile(r"\*\*Modules to read: (\d+)\.\*\*")
FULL_PATH = re.compile(r"`(pdserve/[\w/*.]+\.(?:py|c))`")
CODE = re.compile(r"`([^`]+)`")


def read_doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def map_section(doc: str) -> str:
    start = doc.find(MAP_HEADING + "\n")
    assert start >= 0, f"docs/architecture.md has no section {MAP_HEADING!r}"
    end = doc.find("\n## ", start + len(MAP_HEADING))
    return doc[start:] if end < 0 else doc[start:end]


def map_entries(section: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for line in section.splitlines() if (m := ENTRY.match(line))]


def exists(path: str) -> bool:
    """A repository path (globs allowed, e.g. `engine/cpu_*.c`)."""
    return bool(glob.glob(os.path.join(ROOT, path)))


SHORT_REF = re.compile(r"(?<![\w/.])((?:%s)/[\w/*]+\.(?:py|c|[A-Z]\w*))" % "|".join(PACKAGES))
REPO_REF = re.compile(r"(?<![\w/.])((?:tests|scripts)/[\w/]+\.py)")


def short_ref_target(ref: str) -> str:
    """The file a short reference names, as a glob from the repo root: `worker/loop.py` and
    `disagg/kv_receiver.DecodeReceiver` are modules of pdserve's packages."""
    if ref.endswith((".py", ".c")):
        return f"pdserve/{ref}"
    return f"pdserve/{ref.rsplit('.', 1)[0]}.py"  # module.Class


def test_map_names_real_modules_in_order():
    section = map_section(read_doc())
    entries = map_entries(section)
    assert len(entries) >= 10, "the module map lists almost nothing: did its entry format change?"
    numbers = [n for n, _ in entries]
    assert numbers == list(range(1, len(entries) + 1)), f"entries are not numbered 1..N: {numbers}"
    paths = [p for _, p in entries]
    assert all(p.startswith("pdserve/") and p.endswith(".py") for p in paths), \
        [p for p in paths if not (p.startswith("pdserve/") and p.endswith(".py"))]
    dupes = sorted({p for p in paths if paths.count(p) > 1})
    assert not dupes, f"named twice in the map (count each module where it is first met): {dupes}"
    missing = [f"{n}. {p}" for n, p in entries if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing, f"docs/architecture.md's module map names modules that do not exist: {missing}"


def test_map_states_its_count():
    section = map_section(read_doc())
    stated = [int(n) for n in COUNT.findall(section)]
    assert stated, "the module map does not state its count as **Modules to read: N.**"
    assert stated == [len(map_entries(section))] * len(stated), \
        f"the map states {stated} modules but numbers {len(map_entries(section))}"


def test_every_full_path_in_the_page_exists():
    refs = sorted(set(FULL_PATH.findall(read_doc())))
    assert refs
    missing = [r for r in refs if not exists(r)]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_short_module_reference_exists():
    """Prose and diagrams too: `worker/roles.py`, disagg/kv_sender.PrefillSender, `heartbeat.py`."""
    doc = read_doc()
    missing = [r for r in sorted(set(SHORT_REF.findall(doc))) if not exists(short_ref_target(r))]
    missing += [r for r in sorted(set(REPO_REF.findall(doc))) if not exists(r)]
    bare = {c.split()[0].rstrip(":") for c in CODE.findall(doc) if c.strip()}
    bare = sorted(r for r in bare if re.fullmatch(r"\w+\.(py|c)", r))  # `heartbeat.py`, `cpu_matmul.c`
    missing += [r for r in bare if not glob.glob(os.path.join(ROOT, "pdserve", "**", r), recursive=True)
                and not glob.glob(os.path.join(ROOT, "tests", "**", r), recursive=True)]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_short_references_are_found():
    text = ("`worker/loop.py`, `disagg/dp_rules.py: decide`, worker loop thread: "
            "disagg/kv_receiver.DecodeReceiver, `engine/cpu_*.c`, pdserve/worker/x.py, docs/a.md")
    refs = SHORT_REF.findall(text)
    assert refs == ["worker/loop.py", "disagg/dp_rules.py", "disagg/kv_receiver.DecodeReceiver", "engine/cpu_*.c"]
    assert [short_ref_target(r) for r in refs] == [
        "pdserve/worker/loop.py", "pdserve/disagg/dp_rules.py", "pdserve/disagg/kv_receiver.py",
        "pdserve/engine/cpu_*.c"]


def test_a_missing_module_fails_the_map():
    """The checks above catch a renamed module: the map with one name broken fails them."""
    section = map_section(read_doc())
    broken = section.replace("`pdserve/worker/loop.py`", "`pdserve/worker/no_such_loop.py`", 1)
    assert broken != section, "the map no longer names pdserve/worker/loop.py: pick another module here"
    missing = [p for _, p in map_entries(broken) if not os.path.isfile(os.path.join(ROOT, p))]
    assert missing == ["pdserve/worker/no_such_loop.py"]
