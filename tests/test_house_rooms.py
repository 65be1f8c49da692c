"""The rooms of DESIGN.md, checked on the source: ``integrations/hf``, ``collectives`` and ``bench``.

A *house* is a package cut into rooms (subpackages), with modules beside them: the plumbing or
harness below the rooms (the *floor*) and what stands on top of them (the package's face, hf's
``trainer.py``). Read with ``ast`` through the helpers of ``test_house_rules`` (nothing is imported):

* every module of a house has a place: the face, the floor, the top, or a stage in its room's flow;
* the floor imports no room and nothing on top of it (no import runs back up);
* a module of the house outside a room reaches it only through its face (``__init__``), never a
  module inside it nor a private name of the face, and only the rooms DESIGN.md's room table lets
  it import (rooms import one another one way);
* inside a room no module imports one further along the house's flow, and a room is at most six
  floors deep;
* in ``collectives`` and ``bench`` no two modules of one folder form a prefix family (``cp.py``
  beside ``cp_data.py``, ``ring.py`` beside ``ring_plan.py``): such a family is a room;
* DESIGN.md's room tables name every room, and only rooms.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

import pytest

from tests.test_house_rules import ROOT, edges, imports, is_module, modules


@dataclass(frozen=True)
class House:
    package: str  # the package cut into rooms
    flow: tuple[str, ...]  # the stages of a room's flow, in order: no module imports a later one
    rooms: dict[str, dict[str, str]]  # room -> its modules (the first name under it) -> stage
    may_import: dict[str, tuple[str, ...]] = field(default_factory=dict)  # room -> rooms it may import
    floor: tuple[str, ...] = ()  # modules beside the rooms, below them
    top: tuple[str, ...] = ()  # modules beside the rooms, on top of them (besides the face)
    no_prefix_families: bool = False


HOUSES = {
    # read the batch, plan in numpy, move through collectives, hook into the model
    "hf": House(
        "mmbalance.integrations.hf",
        flow=("read", "plan", "move", "hook"),
        rooms={
            "attention": {"compile": "read", "mask": "read", "plan": "plan", "backend": "hook"},
            "encoders": {
                "adapter": "read",
                "models": "read",
                "link": "read",
                "plan": "plan",
                "move": "move",
                "balance": "hook",
            },
            "cp": {
                "inputs": "read",
                "shard": "read",
                "family": "read",
                "recent": "read",
                "families": "read",
                "plan": "plan",
                "slots": "plan",
                "vlm_plan": "plan",
                "vlm_cut": "plan",
                "collate": "plan",
                "stream": "plan",
                "step": "move",
                "stream_step": "move",
                "vlm_step": "move",
                "linear": "hook",
                "blocks": "hook",
                "attention": "hook",
                "media": "hook",
                "handle": "hook",
            },
        },
        may_import={"cp": ("attention", "encoders")},
        # what differs between transformers releases; the model in its wrappers; the balance in the logs;
        # which trainers' losses regrouping keeps
        floor=("compat", "wrappers", "logs", "loss", "mixers", "lengths"),
        top=("loaders", "trainer", "every"),
    ),  # fmt: skip
    # plan (host arithmetic, the same on every rank), the transports, the entry calls (agreement,
    # then the data moves), what drives them (a step's moves, the tensor-parallel linears)
    "collectives": House(
        "mmbalance.collectives",
        flow=("plan", "transport", "call", "drive"),
        rooms={
            "exchange": {"alltoall": "call", "broadcast": "call", "orchestrator": "drive"},
            "ring": {"plan": "plan", "attention": "call"},
            "overlap": {
                "plan": "plan",
                "_copy_engine": "transport",
                "comm": "transport",
                "matmul": "call",
                "tp_linear": "drive",
            },
        },
        floor=("group", "inflight", "agreement", "pool", "teardown"),
        no_prefix_families=True,
    ),  # fmt: skip
    # what a benchmark stands on (its data, the schemes or model it times, the peers, the kernel
    # variants), the parts it measures, the command that runs them
    "bench": House(
        "mmbalance.bench",
        flow=("input", "measure", "command"),
        rooms={
            "attention": {
                "batch": "input",
                "long": "measure",
                "ring": "measure",
                "blocks": "command",
                "tiles": "command",
                "__main__": "command",
            },
            "cp": {
                "data": "input",
                "schemes": "input",
                "vlm": "measure",
                "window": "measure",
                "real": "measure",
                "sweep": "command",
                "gdn": "command",
                "__main__": "command",
            },
            "demo": {"model": "input", "train": "command", "__main__": "command"},
            "hf": {"train_step": "measure", "encoders": "command", "__main__": "command"},
            "kernel_audit": {"variants": "input", "audit": "command", "__main__": "command"},
            "moves": {"varlen": "command", "alltoall": "command", "overlap": "command"},
            "planners": {
                "peers": "input",
                "schedulers": "measure",
                "post_balancing": "command",
                "sampler": "command",
                "simulate": "command",
                "__main__": "command",
            },
        },
        may_import={"attention": ("kernel_audit",)},
        floor=("harness", "processes", "profile", "regress"),
        no_prefix_families=True,
    ),  # fmt: skip
}
MAX_FLOORS = 6


def house_of(mod: str) -> House | None:
    for house in HOUSES.values():
        if mod == house.package or mod.startswith(house.package + "."):
            return house
    return None


def room_of(mod: str) -> tuple[House, str] | None:
    """The house and room ``mod`` (a module, a room's face included) belongs to, if any."""
    house = house_of(mod)
    if house is None or mod == house.package:
        return None
    room = mod[len(house.package) + 1 :].split(".")[0]
    return (house, room) if room in house.rooms else None


def face_of(house: House, room: str) -> str:
    return f"{house.package}.{room}"


def stage_of(mod: str) -> str | None:
    found = room_of(mod)
    if found is None:
        return None
    house, room = found
    if mod == face_of(house, room):
        return None
    return house.rooms[room].get(mod[len(face_of(house, room)) + 1 :].split(".")[0])


def house_modules(house: House) -> list[str]:
    return [m for m in modules() if m == house.package or m.startswith(house.package + ".")]


def room_modules(house: House, room: str) -> list[str]:
    face = face_of(house, room)
    return [m for m in modules() if m == face or m.startswith(face + ".")]


def beside(house: House, names: tuple[str, ...]) -> set[str]:
    return {f"{house.package}.{n}" for n in names}


def target_of(imp) -> str:
    """The module an import runs: the submodule of ``from package import submodule``."""
    if imp.name is not None and is_module(f"{imp.target}.{imp.name}"):
        return f"{imp.target}.{imp.name}"
    return imp.target


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(HOUSES))
def test_every_module_of_a_house_has_a_place(name):
    house = HOUSES[name]
    placed = {house.package} | beside(house, house.floor) | beside(house, house.top)
    missing = []
    for mod in house_modules(house):
        if mod in placed:
            continue
        found = room_of(mod)
        if found is None:
            missing.append(f"{mod} (in no room, neither floor nor top)")
        elif mod != face_of(*found) and stage_of(mod) is None:
            missing.append(f"{mod} (no stage in its room's flow)")
    stale = [
        f"{house.package}.{n}" for n in (*house.floor, *house.top) if f"{house.package}.{n}" not in modules()
    ]
    stale += [face_of(house, r) for r in house.rooms if face_of(house, r) not in modules()]
    assert not missing, "modules without a place in HOUSES:\n" + "\n".join(missing)
    assert not stale, f"HOUSES names modules or rooms that do not exist: {stale}"


@pytest.mark.parametrize("name", list(HOUSES))
def test_the_floor_imports_no_room(name):
    """The plumbing or harness beside the rooms stands below them: it imports no room and nothing
    on top (the house's face, its top modules)."""
    house = HOUSES[name]
    above = {house.package} | beside(house, house.top)
    problems = []
    for mod in sorted(beside(house, house.floor)):
        for imp in imports(mod):
            target = target_of(imp)
            if room_of(target) is not None or target in above:
                problems.append(f"{mod} line {imp.line} imports {target}, above the floor")
    assert not problems, "\n".join(problems)


def face_problems(house: House) -> list[str]:
    problems = []
    for mod in house_modules(house):
        here = room_of(mod)
        for imp in imports(mod):
            target = target_of(imp)
            there = room_of(target)
            if there is None or there[0] is not house or (here is not None and here[1] == there[1]):
                continue
            room = there[1]
            face = face_of(house, room)
            if target != face:
                problems.append(
                    f"{mod} line {imp.line} imports {target}, inside the room {room} (use {face})"
                )
            elif imp.name is not None and imp.name.startswith("_"):
                problems.append(f"{mod} line {imp.line} imports the private {imp.name} of {face}")
            if here is not None and room not in house.may_import.get(here[1], ()):
                problems.append(
                    f"{mod} line {imp.line} imports the room {room}, which the room {here[1]} may not import"
                )
    return problems


@pytest.mark.parametrize("name", list(HOUSES))
def test_rooms_talk_through_their_faces(name):
    """A module of one room, the house's face and its floor and top modules reach a room only
    through its ``__init__`` (never a module inside it, never a private name of its face), and a room
    only the rooms its row of DESIGN.md's table names."""
    problems = face_problems(HOUSES[name])
    assert not problems, "\n".join(problems)


def floors_of(graph: dict[str, set[str]]) -> dict[str, int]:
    """Every module's floor in an acyclic import graph: 1 for a module that imports none of it,
    else one above the highest it imports."""
    floors: dict[str, int] = {}

    def floor(m: str) -> int:
        if m not in floors:
            floors[m] = 0  # no cycle here (test_no_import_cycle)
            floors[m] = 1 + max((floor(n) for n in graph[m]), default=0)
        return floors[m]

    for m in graph:
        floor(m)
    return floors


def room_problems(house: House, room: str, graph: dict[str, set[str]]) -> list[str]:
    """What breaks the room's rules in ``graph`` (its modules and their imports inside it): more
    than ``MAX_FLOORS`` floors, or an import of a module further along the house's flow."""
    problems = []
    floors = floors_of(graph)
    deepest = max(floors.values(), default=0)
    if deepest > MAX_FLOORS:
        top = max(graph, key=floors.__getitem__)
        problems.append(f"the room {room} is {deepest} floors deep (at most {MAX_FLOORS}), at {top}")
    for m in graph:
        here = stage_of(m)
        if here is None:
            continue
        for n in graph[m]:
            there = stage_of(n)
            if there is not None and house.flow.index(there) > house.flow.index(here):
                problems.append(f"{m} ({here}) imports {n}, further along the flow ({there})")
    return problems


@pytest.mark.parametrize("name", list(HOUSES))
def test_rooms_flow_one_way_and_stay_shallow(name):
    house = HOUSES[name]
    problems = []
    for room in house.rooms:
        mods = set(room_modules(house, room))
        problems += room_problems(house, room, {m: edges(m) & mods for m in mods})
    assert not problems, "\n".join(problems)


def prefix_families(names: list[str]) -> list[list[str]]:
    """Groups of module names of one folder that share a first word (``cp``, ``cp_data``,
    ``cp_real``; ``ring``, ``ring_plan``); leading underscores do not count."""
    by: dict[str, list[str]] = {}
    for name in names:
        if not (name.startswith("__") and name.endswith("__")):
            by.setdefault(name.lstrip("_").split("_")[0], []).append(name)
    return [sorted(group) for group in by.values() if len(group) > 1]


@pytest.mark.parametrize("name", [n for n, h in HOUSES.items() if h.no_prefix_families])
def test_no_flat_prefix_families(name):
    house = HOUSES[name]
    folders: dict[str, list[str]] = {}
    for mod in house_modules(house):
        parent, _, last = mod.rpartition(".")
        folder = mod if modules()[mod].name == "__init__.py" else parent
        if mod != folder:
            folders.setdefault(folder, []).append(last)
        if folder != house.package and mod == folder and parent:
            folders.setdefault(parent, []).append(last)  # a room counts among its folder's names
    found = [
        f"{folder}: {group}" for folder, names in sorted(folders.items()) for group in prefix_families(names)
    ]
    assert not found, "prefix families (make each a room):\n" + "\n".join(found)


def design_rooms() -> set[str]:
    """The rooms DESIGN.md's room tables name: rows ``| `hf/cp/` | ...``."""
    named = set()
    for line in (ROOT / "DESIGN.md").read_text().splitlines():
        row = re.match(r"\| `(\w+)/(\w+)/` \|", line)
        if row and row.group(1) in HOUSES:
            named.add(f"{row.group(1)}/{row.group(2)}")
    return named


def test_design_names_every_room():
    rooms = {f"{name}/{room}" for name, house in HOUSES.items() for room in house.rooms}
    named = design_rooms()
    assert not rooms - named, f"rooms DESIGN.md's room tables do not name: {sorted(rooms - named)}"
    assert not named - rooms, f"DESIGN.md's room tables name rooms that do not exist: {sorted(named - rooms)}"


def test_the_room_checks_find_a_deep_room_a_backward_import_and_a_family():
    hf, bench = HOUSES["hf"], HOUSES["bench"]
    assert floors_of({"a": {"b"}, "b": {"c"}, "c": set()}) == {"a": 3, "b": 2, "c": 1}
    plan, step, media = (f"{hf.package}.cp.{m}" for m in ("plan", "step", "media"))
    assert room_problems(hf, "cp", {plan: set(), step: {plan}, media: {step}}) == []
    (backward,) = room_problems(hf, "cp", {plan: {step}, step: set()})
    assert backward.startswith(f"{plan} (plan) imports {step}")
    chain = [
        f"{hf.package}.cp.{m}"
        for m in ("handle", "attention", "media", "step", "stream_step", "plan", "slots")
    ]
    deep = {m: {n} for m, n in zip(chain, chain[1:])} | {chain[-1]: set()}  # 7 floors, one way
    (too_deep,) = room_problems(hf, "cp", deep)
    assert too_deep == f"the room cp is 7 floors deep (at most {MAX_FLOORS}), at {chain[0]}"
    data, sweep = f"{bench.package}.cp.data", f"{bench.package}.cp.sweep"
    (backward,) = room_problems(bench, "cp", {data: {sweep}, sweep: set()})
    assert backward.startswith(f"{data} (input) imports {sweep}")
    assert prefix_families(["cp", "cp_data", "cp_real", "harness", "__init__", "_copy_engine", "copy"]) == [
        ["cp", "cp_data", "cp_real"],
        ["_copy_engine", "copy"],
    ]
    assert prefix_families(["plan", "comm", "_copy_engine", "matmul", "tp_linear", "__main__"]) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
