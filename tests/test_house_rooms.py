"""The rooms of ``mmbalance.integrations.hf`` (DESIGN.md, "Integrations"), checked on the source.

Read with ``ast`` through the helpers of ``test_house_rules`` (nothing is imported):

* every module of a room has a place in the room's flow (read the batch, plan, move, hook);
* a module outside a room reaches it only through its face (``__init__``), never a module inside
  it nor a private name of the face;
* inside a room no module imports one further along the flow, and a room is at most six floors
  deep.
"""

from __future__ import annotations

import sys

import pytest

from tests.test_house_rules import edges, imports, is_module, modules

HF = "mmbalance.integrations.hf"
ROOMS = ("attention", "encoders", "cp")
# where each module of a room stands in the room's flow (read the batch, plan, move, hook into the
# model), DESIGN.md's order: no module imports one that stands further along; a room's face
# (``__init__``) stands on top
FLOW = ("read", "plan", "move", "hook")
STAGES = {
    "attention": {"compile": "read", "mask": "read", "plan": "plan", "backend": "hook"},
    "encoders": {
        "adapter": "read",
        "models": "read",
        "link": "read",
        "plan": "plan",
        "move": "move",
        "balance": "hook",
    },  # fmt: skip
    "cp": {
        "inputs": "read",
        "shard": "read",
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
        "attention": "hook",
        "media": "hook",
        "handle": "hook",
    },  # fmt: skip
}
MAX_FLOORS = 6


def room_of(mod: str) -> str | None:
    parts = mod.split(".")
    if mod.startswith(HF + ".") and len(parts) > 3 and parts[3] in ROOMS:
        return parts[3]
    return None


def stage_of(mod: str) -> str | None:
    room = room_of(mod)
    if room is None or mod == f"{HF}.{room}":
        return None
    return STAGES[room][mod.split(".")[4]]


def room_modules(room: str) -> list[str]:
    return [m for m in modules() if room_of(m) == room]


def test_every_room_module_has_a_stage():
    missing = [m for room in ROOMS for m in room_modules(room) if m != f"{HF}.{room}" and
               m.split(".")[4] not in STAGES[room]]  # fmt: skip
    assert not missing, f"modules of an hf room without a place in STAGES (its flow): {missing}"


def test_hf_rooms_talk_through_their_faces():
    """A module of one room, ``trainer.py`` and ``hf/__init__.py`` reach another room only through its
    ``__init__`` (never a module inside it, never a private name of its face)."""
    problems = []
    for mod in modules():
        if not (mod == HF or mod.startswith(HF + ".")):
            continue
        here = room_of(mod)
        for imp in imports(mod):
            target = imp.target
            if imp.name is not None and is_module(f"{target}.{imp.name}"):
                target = f"{target}.{imp.name}"
            there = room_of(target)
            if there is None or there == here:
                continue
            face = f"{HF}.{there}"
            if target != face:
                problems.append(
                    f"{mod} line {imp.line} imports {target}, inside the room {there} (use {face})"
                )
            elif imp.name is not None and imp.name.startswith("_"):
                problems.append(f"{mod} line {imp.line} imports the private {imp.name} of {face}")
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


def room_problems(room: str, graph: dict[str, set[str]]) -> list[str]:
    """What breaks the room's rules in ``graph`` (its modules and their imports inside it): more
    than ``MAX_FLOORS`` floors, or an import of a module further along the flow."""
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
            if there is not None and FLOW.index(there) > FLOW.index(here):
                problems.append(f"{m} ({here}) imports {n}, further along the flow ({there})")
    return problems


def test_hf_rooms_flow_one_way_and_stay_shallow():
    problems = []
    for room in ROOMS:
        mods = set(room_modules(room))
        problems += room_problems(room, {m: edges(m) & mods for m in mods})
    assert not problems, "\n".join(problems)


def test_the_room_checks_find_a_deep_room_and_a_backward_import():
    assert floors_of({"a": {"b"}, "b": {"c"}, "c": set()}) == {"a": 3, "b": 2, "c": 1}
    plan, step, media = (f"{HF}.cp.{m}" for m in ("plan", "step", "media"))
    assert room_problems("cp", {plan: set(), step: {plan}, media: {step}}) == []
    (backward,) = room_problems("cp", {plan: {step}, step: set()})
    assert backward.startswith(f"{plan} (plan) imports {step}")
    chain = [f"{HF}.cp.{m}" for m in ("handle", "attention", "media", "step", "stream_step", "plan", "slots")]
    deep = {m: {n} for m, n in zip(chain, chain[1:])} | {chain[-1]: set()}  # 7 floors, one way
    (too_deep,) = room_problems("cp", deep)
    assert too_deep == f"the room cp is 7 floors deep (at most {MAX_FLOORS}), at {chain[0]}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
