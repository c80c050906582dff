"""The `doors` task: a multi-turn, verifiable environment whose observations carry bulky media.

An episode walks through `num_rooms` rooms. Each room is shown as a picture (a text stand-in for an
image) listing objects with numbers; the agent reads the door's number and calls `open_door(code)`:
a right code shows the next room, a wrong one the same room again. So old pictures and `<think>`
blocks pile up in the context: exactly what context compaction drops. The `doors_memory` and
`doors_notes` variants (`env.task`, see `DoorsEnv`) hide a door's code in an earlier picture.

Invariant: an episode is a pure function of its task spec (`{"env", "seed", "num_rooms"}`) and the
agent's calls, and `verify` recomputes the reward from the transcript alone, never from live state:
from the calls the environment ran, those a `function_call_output` in the transcript answers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import lru_cache

from minirl.config import TASK_MIN_ROOMS

OBJECTS = ("lamp", "rug", "box", "desk", "vase", "bell", "coat", "sofa", "clock", "plant")
COLORS = ("red", "blue", "gray", "green", "white", "black", "brown", "gold")
TOOL_NAME = "open_door"
TASKS = ("doors", "doors_memory", "doors_notes")
"""The `task.env` values an episode may have (`env.task`)."""
MIN_ROOMS = TASK_MIN_ROOMS
"""The fewest rooms each task's episode may have (config.py's table)."""
ALL_OPEN = "All doors are open."
"""The environment's reply to the call that opens the last door, and to any call after it."""
NOTE_ROOM = 1
"""`doors_memory`: index of the room whose picture carries the note (the first shown by a tool reply)."""

SYSTEM_PROMPT = "Each picture lists objects with numbers. Call open_door with the door's number."
TOOLS = [
    {
        "type": "function",
        "name": TOOL_NAME,
        "description": "Try a code on the door.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "integer"}},
            "required": ["code"],
        },
    }
]


@dataclass(frozen=True)
class Room:
    """One room: the door's code and the objects the picture shows (door included)."""

    code: int
    objects: tuple[tuple[str, int], ...]
    pixels: tuple[str, ...]

    def picture(self, note: int | str | None = None, hide_door: bool = False, tag: str = "") -> str:
        """Pixels, then one label per line, the door's last (`red blue …\nlamp3\nrug5\ndoor7`).

        Built for a tiny model to read: a name tokenizes the same here as in the agent's reasoning
        (`door`, not the space-prefixed `Ġdoor`), its digit is the very next token, and the door's
        digit sits at a fixed distance before the reply, so reading the door is a fixed-offset copy
        (learned within a few hundred SFT steps) while reading another object needs a content
        lookup the 2-layer warm start barely learns. GRPO then has one clear thing to learn.

        Memory tasks only: `note` adds a `note<note>` label first; `hide_door` shows `door<tag>?`.
        """
        labels = [f"note{note}"] if note is not None else []
        labels += [f"{name}{num}" for name, num in self.objects if name != "door"]
        labels.append(f"door{tag}?" if hide_door else f"door{self.code}")
        return " ".join(self.pixels) + "\n" + "\n".join(labels)


def make_rooms(seed: int, num_rooms: int, distractors: int = 3, pixels: int = 12) -> list[Room]:
    """The rooms of one episode, derived from `seed` alone."""
    return list(_rooms(seed, num_rooms, distractors, pixels))


@lru_cache(maxsize=4096)
def _rooms(seed: int, num_rooms: int, distractors: int, pixels: int) -> tuple[Room, ...]:
    """`make_rooms`, kept: a group's rollouts (and a prompt's row building) ask for the same seed's
    rooms, and drawing them costs ~50 us (rooms are frozen, so sharing them is safe)."""
    rng = random.Random(seed)
    rooms = []
    for _ in range(num_rooms):
        code = rng.randrange(10)
        others = [d for d in range(10) if d != code]
        objects = [(name, rng.choice(others)) for name in rng.sample(OBJECTS, distractors)] + [("door", code)]
        rooms.append(Room(code, tuple(objects), tuple(rng.choice(COLORS) for _ in range(pixels))))
    return tuple(rooms)


@dataclass(frozen=True)
class Note:
    """`doors_notes`: one note, shown as `note<tag><code>` in room `shown_in_room`; `needed_in_room`
    shows `door<tag>?` (None: the distractor, which no room needs)."""

    tag: str
    code: int
    shown_in_room: int
    needed_in_room: int | None

    @property
    def text(self) -> str:
        return f"note{self.tag}{self.code}"


@lru_cache(maxsize=4096)
def note_layout(seed: int, num_rooms: int) -> tuple[Note, ...]:
    """`doors_notes`' notes A, B (needed by the last two rooms, in a drawn order) and C (the
    distractor), shown in three distinct rooms drawn from 1..num_rooms-4; from `seed` alone, by a
    generator of their own (the rooms' draws are `doors`'s).

    The last two rooms hide their doors as `doorA?` / `doorB?`. So a note is at least two rooms older
    than the room that needs it, recency keeping 2 pictures drops every note, and a summary that copies
    one fixed slot (the first or last note shown) carries a needed note a third of the time."""
    rooms = make_rooms(seed, num_rooms)
    rng = random.Random(f"doors_notes|{seed}")
    shown = rng.sample(range(1, num_rooms - 3), 3)
    needed = rng.sample([num_rooms - 2, num_rooms - 1], 2)
    return (Note("A", rooms[needed[0]].code, shown[0], needed[0]),
            Note("B", rooms[needed[1]].code, shown[1], needed[1]),
            Note("C", rng.randrange(10), shown[2], None))


def image_part(text: str) -> dict:
    """A media content part: a text stand-in for an image, as a Responses `input_image`."""
    return {"type": "input_image", "image_url": "data:text/plain," + text, "detail": "auto"}


@dataclass
class DoorsEnv:
    """Live state of one episode; `step` answers one tool call with the observation parts.

    `doors_memory` makes memory matter: the last room's picture hides its door (`door?`), and its
    code is shown once, early, as a `note<code>` label in the first picture a tool call returns (the
    second room's). Recency compaction drops that picture once `keep_last_groups` later pictures follow
    it (with `num_rooms >= keep_last_groups + 2`), and `protect_initial_context` does not keep it (it
    is not in the initial input). `doors_notes` needs several facts and a choice (`note_layout`). For
    the same seed, every variant has `doors`'s rooms, codes and `verify`; only the pictures differ.
    """

    seed: int
    num_rooms: int = 2
    task: str = "doors"
    """`doors`, `doors_memory` (needs `num_rooms >= 3`: the note's room lies between the first and the last)
    or `doors_notes` (needs `num_rooms >= 7`: three note rooms, then a gap of one, then the two that need them)."""
    rooms: list[Room] = field(init=False)
    room: int = 0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.num_rooms < MIN_ROOMS[self.task]:
            raise ValueError(f"{self.task} needs num_rooms >= {MIN_ROOMS[self.task]}, got {self.num_rooms}")
        self.rooms = make_rooms(self.seed, self.num_rooms)

    def memory_facts(self) -> list[dict]:
        """The facts a later room needs that an earlier observation showed once: for `doors_memory`
        `[{"text": "note<code>", "shown_in_room": 1, "needed_in_room": num_rooms - 1}]` (0-based
        rooms; `text` is what the picture shows, so a summary that keeps it verbatim recalls it);
        for `doors_notes` notes A and B (never the distractor C); `[]` for `doors`."""
        if self.task == "doors_notes":
            return [{"text": n.text, "shown_in_room": n.shown_in_room, "needed_in_room": n.needed_in_room}
                    for n in note_layout(self.seed, self.num_rooms) if n.needed_in_room is not None]
        if self.task != "doors_memory":
            return []
        last = self.num_rooms - 1
        return [{"text": f"note{self.rooms[last].code}", "shown_in_room": NOTE_ROOM, "needed_in_room": last}]

    def picture(self, room: int) -> str:
        """The picture of room `room` as this task shows it."""
        if self.task == "doors_notes":
            notes = note_layout(self.seed, self.num_rooms)
            note = next((f"{n.tag}{n.code}" for n in notes if n.shown_in_room == room), None)
            need = next((n.tag for n in notes if n.needed_in_room == room), None)
            return self.rooms[room].picture(note=note, hide_door=need is not None, tag=need or "")
        if self.task != "doors_memory":
            return self.rooms[room].picture()
        note = self.rooms[-1].code if room == NOTE_ROOM else None
        return self.rooms[room].picture(note=note, hide_door=room == self.num_rooms - 1)

    @property
    def done(self) -> bool:
        return self.room >= self.num_rooms

    def initial_input(self) -> list[dict]:
        """The episode's opening items: system prompt, then the first room's picture."""
        return [
            {"type": "message", "role": "system", "content": SYSTEM_PROMPT},
            {"type": "message", "role": "user", "content": self._room_parts("Room 1.")},
        ]

    def _room_parts(self, text: str) -> list[dict]:
        return [{"type": "input_text", "text": text}, image_part(self.picture(self.room))]

    def step(self, name: str, arguments: str) -> list[dict]:
        if self.done:  # a call after the last door (a Gym agent may make one): the episode's last word, again
            return [{"type": "input_text", "text": ALL_OPEN}]
        code = parse_code(name, arguments)
        if code is None:
            return [{"type": "input_text", "text": "Error: call open_door with an integer code."}]
        if code != self.rooms[self.room].code:
            return self._room_parts("Wrong code.")
        self.room += 1
        if self.done:
            return [{"type": "input_text", "text": ALL_OPEN}]
        return self._room_parts(f"Opened. Room {self.room + 1}.")


def parse_code(name: str, arguments: str) -> int | None:
    """The integer code of an `open_door` call, or None when the call is malformed."""
    if name != TOOL_NAME:
        return None
    try:
        code = json.loads(arguments).get("code")
    except (ValueError, AttributeError, TypeError, RecursionError):  # not JSON, not an object, None, too deep
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def verify(task: dict, output_items: list[dict]) -> float:
    """Reward in [0, 1]: per room, 1 if opened on the first try, 0.5 if later, 0 if never.

    Replays the agent's `open_door` calls that the environment ran against the task's rooms
    (`room_scores`); the live env is not consulted.
    """
    return sum(score for _, score in room_scores(task, output_items)) / task["num_rooms"]


def room_scores(task: dict, output_items: list[dict]) -> list[tuple[int, float]]:
    """`verify`'s replay, per room tried: (the index in `output_items` of its first try, its score:
    1 opened on that try, 0.5 later, 0 never). A room never tried is not listed (it scores 0).

    A call is a try only if the environment ran it: a `function_call_output` with its `call_id` answers
    it. A reply cut by the token cap (`finish_reason == "length"`) may still carry a complete call, and
    the agent ends the episode without running it: the door stays shut, so no credit. A call without a
    `call_id` is no transcript item but a bare list of calls to replay (bench/ scores one reply's calls
    so): it counts as run."""
    rooms = make_rooms(task["seed"], task["num_rooms"])
    answered = {item.get("call_id") for item in output_items if item.get("type") == "function_call_output"}
    scores: list[tuple[int, float]] = []
    room, tries = 0, 0
    for i, item in enumerate(output_items):
        if item.get("type") != "function_call" or room >= len(rooms):
            continue
        if item.get("call_id") is not None and item["call_id"] not in answered:
            continue
        if tries == 0:
            scores.append((i, 0.0))
        tries += 1
        if parse_code(item.get("name", ""), item.get("arguments", "")) == rooms[room].code:
            scores[-1] = (scores[-1][0], 1.0 if tries == 1 else 0.5)
            room, tries = room + 1, 0
    return scores
