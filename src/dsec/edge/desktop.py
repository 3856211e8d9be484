"""The screens of a sandbox, as the edge drives them (vocabulary: :mod:`dsec.display`).

Two implementations of :class:`ScreenDriver`:

* :class:`ExecDesktop`: the X desktop of a desktop image, driven from inside the sandbox
  through the tier's ``exec`` (so the same code serves the container and vm tiers). Each
  call is one exec of :data:`HELPER`, a POSIX shell script sent with the call (nothing of it
  lives in the image: an older desktop image works with a newer dsec) that runs the X tools
  the image has: ``xdotool`` (pointer and keys), ``scrot`` (screenshots, returned as base64
  on stdout: one round trip), ``wmctrl`` (windows), ``xdg-open`` and ``gtk-launch``
  (applications, detached with ``setsid``). Its exit status says what went wrong: 3 no X
  server answers (:class:`~dsec.errors.DisplayNotRunning`), 4 bad input (a point off the
  screen, an unknown key or application: ``InvalidRequest``), 5 or 127 a tool is missing
  (``CapabilityNotSupported`` naming the image). It runs as the sandbox's default user (a
  desktop image's ``user``) with ``DISPLAY`` set to the image's display.
* :class:`ConsoleScreen`: a tier's own screen (:class:`dsec.contract.runtime.Display`, the vm
  tier's VGA console through QMP).

Both answer :meth:`ScreenDriver.screenshot`, :meth:`ScreenDriver.act` and
:meth:`ScreenDriver.state`; only the desktop also has windows (:class:`Windowed`).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dsec.contract.runtime import Display, Handle, Runtime
from dsec.display import (
    Button,
    Click,
    DisplayAction,
    DisplayState,
    Drag,
    Key,
    Launch,
    Move,
    Open,
    ScreenKind,
    Scroll,
    Type,
    WindowInfo,
    key_tokens,
)
from dsec.edge.start import image_config_of, start_command_of
from dsec.errors import (
    CapabilityNotSupported,
    DisplayNotRunning,
    InvalidRequest,
    SandboxError,
    SandboxTimeout,
)
from dsec.images.config import StartCommand
from dsec.layers.desktop import DISPLAY_LABEL
from dsec.models import ExecRequest, ExecResult, ImageInfo

__all__ = [
    "HELPER",
    "STOP_SCRIPT",
    "X_KEYSYMS",
    "ConsoleScreen",
    "DesktopSpec",
    "ExecDesktop",
    "ScreenDriver",
    "Windowed",
    "desktop_spec",
    "parse_wmctrl",
    "x_key_chord",
]


@runtime_checkable
class ScreenDriver(Protocol):
    """One screen of one sandbox."""

    kind: ScreenKind

    async def screenshot(self, *, pointer: bool = False) -> bytes:
        """The screen as PNG bytes (``pointer``: with the mouse pointer drawn, if it can)."""
        ...

    async def act(self, action: DisplayAction) -> None:
        """Carry out one input action."""
        ...

    async def state(self) -> DisplayState:
        """The screen's size and the pointer's position (where known)."""
        ...


@runtime_checkable
class Windowed(Protocol):
    """A screen with a window manager: its windows can be listed."""

    async def windows(self) -> list[WindowInfo]:
        """The top-level windows, in the window manager's stacking order."""
        ...


X_KEYSYMS: dict[str, str] = {
    "enter": "Return", "return": "Return", "ret": "Return", "esc": "Escape",
    "escape": "Escape", "tab": "Tab", "space": "space", "spc": "space",
    "backspace": "BackSpace", "bksp": "BackSpace", "delete": "Delete", "del": "Delete",
    "insert": "Insert", "ins": "Insert", "home": "Home", "end": "End",
    "pageup": "Page_Up", "page_up": "Page_Up", "pgup": "Page_Up",
    "pagedown": "Page_Down", "page_down": "Page_Down", "pgdn": "Page_Down",
    "up": "Up", "down": "Down", "left": "Left", "right": "Right",
    "ctrl": "ctrl", "control": "ctrl", "ctrl_l": "Control_L", "ctrl_r": "Control_R",
    "control_left": "Control_L", "control_right": "Control_R",
    "alt": "alt", "alt_l": "Alt_L", "alt_r": "Alt_R", "alt_left": "Alt_L", "alt_right": "Alt_R",
    "shift": "shift", "shift_l": "Shift_L", "shift_r": "Shift_R",
    "shift_left": "Shift_L", "shift_right": "Shift_R",
    "super": "super", "win": "super", "windows": "super", "cmd": "super", "command": "super",
    "meta": "Meta_L", "meta_l": "Meta_L", "menu": "Menu", "capslock": "Caps_Lock",
    "caps_lock": "Caps_Lock", "numlock": "Num_Lock", "num_lock": "Num_Lock",
    "scrolllock": "Scroll_Lock", "scroll_lock": "Scroll_Lock", "print": "Print",
    "sysrq": "Sys_Req", "pause": "Pause", "break": "Pause",
    **{f"f{i}": f"F{i}" for i in range(1, 25)},
}  # fmt: skip
"""Friendly key names -> X keysyms (``xdotool key`` also knows ``ctrl``, ``alt``, ``shift``
and ``super``); any other name goes to xdotool as a keysym name."""


def x_key_chord(name: str) -> str:
    """An ``xdotool key`` chord for a :class:`~dsec.display.Key` name (``"ctrl-c"`` ->
    ``"ctrl+c"``, ``"enter"`` -> ``"Return"``)."""
    try:
        tokens = key_tokens(name)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    return "+".join(X_KEYSYMS.get(t.lower(), t) for t in tokens)


HELPER = r"""set -u
verb=$1
shift
# a tier that starts commands with HOME=/root for every user: the user's own home (the
# applications this starts keep their profiles there); the test first, so the usual call
# (a writable HOME) forks nothing here
if [ ! -w "${HOME:-/nonexistent}" ] && [ "$(id -u)" != 0 ]; then
    HOME=$(getent passwd "$(id -u)" | cut -d: -f6)
    export HOME
fi
x_dead() {
    case "$1" in
        *"pen display"*|*"pen X display"*|*"nable to open display"*|*"annot connect to X"*)
            echo "no X server answers on display ${DISPLAY:-(unset)}: $1" >&2
            exit 3 ;;
    esac
}
need() {
    command -v "$1" > /dev/null 2>&1 || { echo "$1 is not installed" >&2; exit 5; }
}
# run an X client for its effect: a dead display exits 3, an unknown key 4, other failures 1
act() {
    need "$1"
    err=$("$@" 2>&1 > /dev/null)
    rc=$?
    x_dead "$err"
    case "$err" in *"No such key name"*) printf '%s\n' "$err" >&2; exit 4 ;; esac
    if [ $rc -ne 0 ]; then printf '%s\n' "$err" >&2; exit 1; fi
}
geometry() {
    need xdotool
    g=$(xdotool getdisplaygeometry 2>&1) || { x_dead "$g"; echo "$g" >&2; exit 1; }
    set -- $g
    W=$1
    H=$2
}
inside() {
    if [ "$1" -ge "$W" ] || [ "$2" -ge "$H" ]; then
        echo "size $W $H"
        echo "($1, $2) is outside the ${W}x${H} screen" >&2
        exit 4
    fi
}
detach() {
    setsid -f "$@" >> /tmp/.dsec-display.log 2>&1 < /dev/null
}
case "$verb" in
shot)
    need scrot
    f=/tmp/.dsec-shot-$$.png
    if [ "$1" = 1 ]; then err=$(scrot -o --pointer "$f" 2>&1); else err=$(scrot -o "$f" 2>&1); fi
    rc=$?
    x_dead "$err"
    if [ $rc -ne 0 ]; then rm -f "$f"; printf '%s\n' "$err" >&2; exit 1; fi
    base64 -w 0 "$f"
    rm -f "$f"
    ;;
move)
    geometry; inside "$1" "$2"
    act xdotool mousemove "$1" "$2"
    ;;
click)
    if [ "$4" = 1 ]; then rep="--repeat 2 --delay 40"; else rep="--delay 0"; fi
    if [ -n "$1" ]; then
        geometry; inside "$1" "$2"
        act xdotool mousemove "$1" "$2" click $rep "$3"
    else
        act xdotool click $rep "$3"
    fi
    ;;
drag)
    geometry; inside "$1" "$2"; inside "$3" "$4"
    set -- "$@" $(( $1 + ($3 - $1) / 3 )) $(( $2 + ($4 - $2) / 3 )) \
        $(( $1 + 2 * ($3 - $1) / 3 )) $(( $2 + 2 * ($4 - $2) / 3 ))
    act xdotool mousemove "$1" "$2" mousedown "$5" sleep 0.03 mousemove "$6" "$7" sleep 0.02 \
        mousemove "$8" "$9" sleep 0.02 mousemove "$3" "$4" sleep 0.03 mouseup "$5"
    ;;
scroll)
    if [ -n "$3" ]; then
        geometry; inside "$3" "$4"
        act xdotool mousemove "$3" "$4" click --repeat "$2" --delay 8 "$1"
    else
        act xdotool click --repeat "$2" --delay 8 "$1"
    fi
    ;;
button)
    act xdotool "$2" "$1"
    ;;
type)
    act xdotool type --delay "$1" -- "$2"
    ;;
key)
    act xdotool key --delay 0 "$1"
    ;;
state)
    geometry
    m=$(xdotool getmouselocation --shell 2>&1) || { x_dead "$m"; echo "$m" >&2; exit 1; }
    echo "size $W $H"
    printf '%s\n' "$m"
    ;;
windows)
    need wmctrl
    out=$(wmctrl -lxpG 2>&1)
    rc=$?
    x_dead "$out"
    if [ $rc -ne 0 ]; then
        # a window manager that has not published its client list yet manages no window
        case "$out" in *"annot get client list"*) exit 0 ;; esac
        echo "no window manager runs on ${DISPLAY:-?}: $out" >&2
        exit 3
    fi
    printf 'active %s\n' "$(xdotool getactivewindow 2>/dev/null)"
    printf '%s\n' "$out"
    ;;
open)
    need xdg-open
    geometry
    case "$1" in
        /*) [ -e "$1" ] || { echo "no such file in the sandbox: $1" >&2; exit 4; } ;;
    esac
    detach xdg-open "$1"
    ;;
launch)
    geometry
    app=$1
    shift
    for d in "${HOME:-/nonexistent}/.local/share/applications" /usr/local/share/applications \
        /usr/share/applications; do
        if [ -f "$d/$app.desktop" ]; then
            need gtk-launch
            detach gtk-launch "$app" "$@"
            exit 0
        fi
    done
    if command -v "$app" > /dev/null 2>&1; then
        detach "$app" "$@"
        exit 0
    fi
    known=$(ls /usr/share/applications 2>/dev/null | sed -n 's/\.desktop$//p' | tr '\n' ' ')
    echo "no application $app: neither a desktop entry nor a command (desktop entries: $known)" >&2
    exit 4
    ;;
*)
    echo "unknown verb $verb" >&2
    exit 2
    ;;
esac
"""
"""The in-sandbox side of :class:`ExecDesktop` (``sh -c HELPER dsec-display VERB ARGS``)."""

_BUTTONS = {"left": "1", "middle": "2", "right": "3"}
_WHEEL = {"up": "4", "down": "5", "left": "6", "right": "7"}
_MISSING_TOOL = re.compile(r"(\S+): (?:not found|is not installed)")
_MAX_SHOT_BYTES = 48 << 20


class ExecDesktop:
    """The X desktop on ``display`` of the sandbox ``handle`` (see the module docstring).

    Args:
        runtime: the sandbox's tier (its ``exec`` runs the helper).
        handle: the sandbox.
        display: the X display (``:0``).
        image: the sandbox's image name (for error messages).
        not_running: called when no X server answers, for a sentence on why (the start
            command's fate); its result ends the error message.
    """

    kind: ScreenKind = "desktop"

    def __init__(
        self,
        runtime: Runtime,
        handle: Handle,
        display: str,
        image: str,
        not_running: Callable[[], str] | None = None,
    ) -> None:
        self.runtime = runtime
        self.handle = handle
        self.display = display
        self.image = image
        self._not_running = not_running

    async def _run(
        self, verb: str, *args: str, timeout_s: float = 30.0, max_output: int = 1 << 20
    ) -> ExecResult:
        req = ExecRequest(
            cmd=["/bin/sh", "-c", HELPER, "dsec-display", verb, *args],
            env={"DISPLAY": self.display},
            timeout_s=timeout_s,
            max_output_bytes=max_output,
        )
        res = await self.runtime.exec(self.handle, req)
        if res.timed_out:
            raise SandboxTimeout(
                f"display {verb} did not finish within {timeout_s:g} s", sandbox_id=self.handle.id
            )
        if res.exit_code == 0:
            return res
        message = res.stderr.strip()[-2000:] or f"exit status {res.exit_code}"
        if res.exit_code == 3:
            why = self._not_running() if self._not_running is not None else ""
            raise DisplayNotRunning(
                f"the desktop of sandbox {self.handle.id} is not running ({message})"
                + (f"; {why}" if why else "")
                + "; sb.display.restart() starts it again",
                sandbox_id=self.handle.id,
                display=self.display,
            )
        if res.exit_code == 4:
            details: dict[str, object] = {}
            for line in res.stdout.splitlines():
                if line.startswith("size "):
                    _, w, h = line.split()
                    details = {"width": int(w), "height": int(h)}
            raise InvalidRequest(message, **details)
        if res.exit_code in (5, 127):
            tool = _MISSING_TOOL.search(message)
            raise CapabilityNotSupported(
                f"image {self.image!r} lacks {tool.group(1) if tool else 'a program'} its "
                f"desktop needs for {verb} ({message})",
                image=self.image,
            )
        raise SandboxError(
            f"display {verb} failed (exit {res.exit_code}): {message}",
            sandbox_id=self.handle.id,
            exit_code=res.exit_code,
        )

    async def screenshot(self, *, pointer: bool = False) -> bytes:
        """The screen as PNG bytes (``scrot``; 30-55 ms at 1024x768 in a container, most
        of it scrot's PNG encoding)."""
        res = await self._run("shot", "1" if pointer else "0", max_output=_MAX_SHOT_BYTES)
        if res.stdout_truncated:
            raise SandboxError("the screenshot is larger than 48 MiB", sandbox_id=self.handle.id)
        try:
            data = base64.b64decode(res.stdout.strip(), validate=True)
        except (binascii.Error, ValueError) as e:
            raise SandboxError(f"scrot produced no readable image: {e}") from e
        if data[:8] != b"\x89PNG\r\n\x1a\n":
            raise SandboxError("scrot did not produce a PNG", sandbox_id=self.handle.id)
        return data

    async def act(self, action: DisplayAction) -> None:
        """One action through ``xdotool`` / ``xdg-open`` / ``gtk-launch``."""
        if isinstance(action, Move):
            await self._run("move", str(action.x), str(action.y))
        elif isinstance(action, Click):
            x = "" if action.x is None else str(action.x)
            y = "" if action.y is None else str(action.y)
            double = "1" if action.double else "0"
            await self._run("click", x, y, _BUTTONS[action.button], double)
        elif isinstance(action, Drag):
            await self._run(
                "drag",
                *map(str, (action.from_x, action.from_y, action.to_x, action.to_y)),
                _BUTTONS[action.button],
            )
        elif isinstance(action, Scroll):
            x = "" if action.x is None else str(action.x)
            y = "" if action.y is None else str(action.y)
            await self._run("scroll", _WHEEL[action.direction], str(action.amount), x, y)
        elif isinstance(action, Button):
            await self._run(
                "button", _BUTTONS[action.button], "mousedown" if action.down else "mouseup"
            )
        elif isinstance(action, Type):
            seconds = 30.0 + len(action.text) * (action.delay_ms + 2) / 1000
            await self._run("type", str(action.delay_ms), action.text, timeout_s=seconds)
        elif isinstance(action, Key):
            await self._run("key", x_key_chord(action.name))
        elif isinstance(action, Open):
            await self._run("open", action.target)
        elif isinstance(action, Launch):
            await self._run("launch", action.app, *action.args)
        else:  # pragma: no cover - the union is closed
            raise InvalidRequest(f"unknown display action {action!r}")

    async def state(self) -> DisplayState:
        """Screen size (``xdotool getdisplaygeometry``) and pointer (``getmouselocation``)."""
        res = await self._run("state")
        values: dict[str, int] = {}
        for line in res.stdout.splitlines():
            if line.startswith("size "):
                _, w, h = line.split()
                values["width"], values["height"] = int(w), int(h)
            else:
                key, _, value = line.partition("=")
                if key in ("X", "Y") and value.strip().lstrip("-").isdigit():
                    values[key] = int(value)
        if "width" not in values:
            raise SandboxError(f"the desktop reported no screen size: {res.stdout[:200]!r}")
        return DisplayState(
            screen="desktop",
            width=values["width"],
            height=values["height"],
            cursor_x=values.get("X"),
            cursor_y=values.get("Y"),
            display=self.display,
        )

    async def windows(self) -> list[WindowInfo]:
        """``wmctrl -lxpG``: id, desktop, pid, geometry, WM_CLASS, host, title."""
        res = await self._run("windows")
        return parse_wmctrl(res.stdout)


def parse_wmctrl(text: str) -> list[WindowInfo]:
    """Windows from the helper's ``windows`` output: an ``active <id>`` line (decimal, from
    ``xdotool getactivewindow``; empty when no window has the focus), then ``wmctrl -lxpG``
    lines (``0x01600004  0 151  10 37 1004 721  chromium.Chromium  host  Title words``)."""
    active: int | None = None
    out: list[WindowInfo] = []
    for line in text.splitlines():
        if line.startswith("active "):
            value = line[7:].strip()
            active = int(value) if value.isdigit() else None
            continue
        parts = line.split(None, 9)
        if len(parts) < 8 or not parts[0].startswith("0x"):
            continue
        try:
            wid = int(parts[0], 16)
            pid = int(parts[2])
            x, y, w, h = (int(v) for v in parts[3:7])
        except ValueError:
            continue
        instance, _, cls = parts[7].partition(".")
        if parts[7] == "N/A":
            instance, cls = "", ""
        title = parts[9] if len(parts) > 9 else ""
        out.append(
            WindowInfo(
                id=wid,
                title=title,
                wm_class=cls,
                wm_instance=instance,
                pid=pid if pid > 0 else None,
                x=x,
                y=y,
                width=w,
                height=h,
                active=active == wid,
            )
        )
    return out


class ConsoleScreen:
    """A tier's own screen (:class:`dsec.contract.runtime.Display`) of the sandbox ``handle``."""

    kind: ScreenKind = "console"

    def __init__(self, display: Display, handle: Handle) -> None:
        self._display = display
        self.handle = handle

    async def screenshot(self, *, pointer: bool = False) -> bytes:
        """The console as QEMU renders it (the pointer is not drawn on a console)."""
        return await self._display.screenshot(self.handle)

    async def act(self, action: DisplayAction) -> None:
        if isinstance(action, Open | Launch):
            raise CapabilityNotSupported(
                f"the console screen has no applications to {action.action}: use a desktop "
                "image (image='desktop') and screen='desktop'",
                screen="console",
            )
        await self._display.screen_act(self.handle, action)

    async def state(self) -> DisplayState:
        width, height = await self._display.screen_size(self.handle)
        pointer = self._display.pointer(self.handle)
        return DisplayState(
            screen="console",
            width=width,
            height=height,
            cursor_x=pointer[0] if pointer else None,
            cursor_y=pointer[1] if pointer else None,
        )


_DISPLAY_RE = re.compile(r"^:[0-9]{1,4}(\.[0-9]{1,2})?$")


@dataclass(frozen=True)
class DesktopSpec:
    """What the edge knows about a sandbox's desktop from its image.

    Attributes:
        display: the X display (the image config's :data:`~dsec.layers.desktop.DISPLAY_LABEL`).
        image: the image's name.
        start: the image's start command, which runs the desktop (``restart`` runs it again).
    """

    display: str
    image: str
    start: StartCommand | None


def desktop_spec(image: ImageInfo) -> DesktopSpec | None:
    """The desktop of sandboxes of ``image`` (None when its config has no valid
    ``dsec.display`` label)."""
    labels = image_config_of(image).Labels or {}
    display = labels.get(DISPLAY_LABEL)
    if not isinstance(display, str) or not _DISPLAY_RE.match(display):
        return None
    return DesktopSpec(display=display, image=image.name, start=start_command_of(image))


STOP_SCRIPT = r"""set -u
d=$1
n=${d#:}
n=${n%%.*}
state=/tmp/.dsec-desktop/$n
if [ -f "$state/supervisor.pid" ]; then
    pg=$(ps -o pgid= -p "$(cat "$state/supervisor.pid")" 2>/dev/null | tr -d ' ')
    [ -n "$pg" ] && [ "$pg" != "$(ps -o pgid= -p $$ | tr -d ' ')" ] && kill -KILL -- "-$pg" 2>/dev/null
fi
if [ -f "/tmp/.X$n-lock" ]; then
    xp=$(tr -d ' ' < "/tmp/.X$n-lock")
    [ -n "$xp" ] && kill -KILL "$xp" 2>/dev/null
fi
for _ in $(seq 200); do
    if [ -f "/tmp/.X$n-lock" ] && kill -0 "$(tr -d ' ' < "/tmp/.X$n-lock")" 2>/dev/null; then
        sleep 0.05
    else
        break
    fi
done
rm -f "/tmp/.X$n-lock" "/tmp/.X11-unix/X$n" "$state/supervisor.pid" "$state/xvfb.pid" "$state/bus"
"""
"""What ``restart`` runs before the start command again: kill the old desktop (its
supervisor's process group, the X server holding the display's lock) and clear its files."""
