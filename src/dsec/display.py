"""The display API's vocabulary: which screen, the closed set of input actions, and what the
queries answer. Shared by the apiserver (which parses requests into these), the edge (which
acts on them) and the SDK.

Screens (``screen``):

* ``desktop``: the X desktop of a desktop image (the ``desktop`` built-in, or any image whose
  config carries the label ``dsec.display``), on any tier. Actions run inside the sandbox
  (``xdotool``, ``scrot``, ``wmctrl``, ``xdg-open``, ``gtk-launch``) through its exec.
* ``console``: the tier's own screen, the vm tier's VGA console (QEMU renders it; input by
  QMP). No windows, ``open`` or ``launch`` there.
* ``auto`` (the default): the desktop if the image has one, else the console if the tier
  has one.

Coordinates are pixels of the screenshot, (0, 0) at the top left; a point off the screen is
refused (``InvalidRequest`` with ``width`` and ``height`` in its details).

Key names (:class:`Key`): one key or a chord joined by ``+`` or ``-`` (``enter``, ``ctrl+c``,
``ctrl-alt-delete``, ``shift+Tab``, ``F5``, ``a``). Friendly names (``enter``, ``esc``,
``backspace``, ``pageup``, ``win``...) work on both screens; on the desktop any X keysym
name does too (``Return``, ``Page_Up``, ``XF86Back``).

Example::

    from dsec.display import Click, Type
    actions = [Click(x=10, y=20), Type(text="hello\\n")]
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "KEY_PATTERN",
    "MAX_COORD",
    "MAX_TYPE_CHARS",
    "Button",
    "Click",
    "DisplayAction",
    "DisplayState",
    "Drag",
    "Key",
    "Launch",
    "MouseButton",
    "Move",
    "Open",
    "Screen",
    "ScreenKind",
    "Scroll",
    "Type",
    "WindowInfo",
    "key_tokens",
]

Screen = Literal["auto", "desktop", "console"]
ScreenKind = Literal["desktop", "console"]
MouseButton = Literal["left", "right", "middle"]

MAX_COORD = 16384
"""Largest pixel coordinate accepted (screens are smaller; the edge checks the real size)."""
MAX_TYPE_CHARS = 10_000
"""Longest text one ``type`` action sends (characters)."""
KEY_PATTERN = r"^[A-Za-z0-9_]+([+-][A-Za-z0-9_]+)*$"

Coord = Annotated[int, Field(ge=0, le=MAX_COORD)]


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _both_or_neither(x: int | None, y: int | None) -> None:
    if (x is None) != (y is None):
        raise ValueError("give both x and y, or neither (act where the pointer is)")


class Move(_Action):
    """Move the pointer to pixel (``x``, ``y``)."""

    action: Literal["move"] = "move"
    x: Coord
    y: Coord


class Click(_Action):
    """Click ``button`` at (``x``, ``y``), or where the pointer is when both are None;
    ``double`` clicks twice (a double click)."""

    action: Literal["click"] = "click"
    x: Coord | None = None
    y: Coord | None = None
    button: MouseButton = "left"
    double: bool = False

    @model_validator(mode="after")
    def _xy(self) -> Click:
        _both_or_neither(self.x, self.y)
        return self


class Drag(_Action):
    """Press ``button`` at (``from_x``, ``from_y``), move to (``to_x``, ``to_y``), release."""

    action: Literal["drag"] = "drag"
    from_x: Coord
    from_y: Coord
    to_x: Coord
    to_y: Coord
    button: MouseButton = "left"


class Scroll(_Action):
    """Turn the wheel ``amount`` notches ``direction`` (at (``x``, ``y``) if given)."""

    action: Literal["scroll"] = "scroll"
    direction: Literal["up", "down", "left", "right"] = "down"
    amount: int = Field(1, ge=1, le=100)
    x: Coord | None = None
    y: Coord | None = None

    @model_validator(mode="after")
    def _xy(self) -> Scroll:
        _both_or_neither(self.x, self.y)
        return self


class Button(_Action):
    """Press (``down``) or release a mouse button where the pointer is (drags by hand)."""

    action: Literal["button"] = "button"
    button: MouseButton = "left"
    down: bool = True


class Type(_Action):
    """Type ``text`` on the keyboard (``\\n`` is Enter, ``\\t`` Tab). ``delay_ms``: pause
    after each key (0: as fast as the X server takes them; the console always paces keys)."""

    action: Literal["type"] = "type"
    text: str = Field(min_length=1, max_length=MAX_TYPE_CHARS)
    delay_ms: int = Field(0, ge=0, le=1000)


class Key(_Action):
    """Press a key or a chord (see the module docstring for names)."""

    action: Literal["key"] = "key"
    name: str = Field(pattern=KEY_PATTERN, max_length=64)


class Open(_Action):
    """Open a URL (``http(s)://``, ``file://``) or an absolute path inside the sandbox with
    the desktop's default application (``xdg-open``: Chromium for web pages). Returns once
    the application is launched; its window appears shortly after (see ``windows``)."""

    action: Literal["open"] = "open"
    target: str = Field(min_length=1, max_length=4096)

    @model_validator(mode="after")
    def _target(self) -> Open:
        t = self.target
        if "\0" in t or "\n" in t:
            raise ValueError("target must not contain NUL or newline characters")
        if not (t.startswith("/") or "://" in t or t.startswith(("about:", "mailto:"))):
            raise ValueError("target must be a URL (scheme://...) or an absolute path")
        return self


class Launch(_Action):
    """Start an application: a desktop entry id (``chromium``, ``xfce4-terminal``,
    ``thunar``: ``gtk-launch``) or else a command on ``PATH``, with ``args`` (URIs for a
    desktop entry). Returns once it is started."""

    action: Literal["launch"] = "launch"
    app: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$", max_length=128)
    args: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _args(self) -> Launch:
        if any("\0" in a for a in self.args):
            raise ValueError("args must not contain NUL characters")
        return self


DisplayAction = Annotated[
    Move | Click | Drag | Scroll | Button | Type | Key | Open | Launch,
    Field(discriminator="action"),
]
"""One input action (the ``action`` field names which)."""


class DisplayState(BaseModel):
    """What a screen looks like now: its size (pixels) and, where it is known, the pointer."""

    model_config = ConfigDict(extra="ignore")

    screen: ScreenKind
    width: int
    height: int
    cursor_x: int | None = None
    cursor_y: int | None = None
    display: str | None = Field(None, description="the X display of a desktop (':0')")


class WindowInfo(BaseModel):
    """One top-level window the desktop's window manager manages (``wmctrl -l``)."""

    model_config = ConfigDict(extra="ignore")

    id: int = Field(description="X window id (the number xdotool uses)")
    title: str
    wm_class: str = Field(description="the class of WM_CLASS ('Chromium')")
    wm_instance: str = Field(description="the instance of WM_CLASS ('chromium')")
    pid: int | None = None
    x: int
    y: int
    width: int
    height: int
    active: bool = False


def key_tokens(name: str) -> list[str]:
    """The keys of a chord name, in order (``"ctrl+shift+t"`` -> ``["ctrl", "shift", "t"]``).

    Raises:
        ValueError: an empty name or an empty part.
    """
    parts = name.replace("-", "+").split("+")
    if not name or any(not p for p in parts):
        raise ValueError(f"malformed key name {name!r}")
    return parts
