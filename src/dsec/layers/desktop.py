"""The ``desktop`` image: an X desktop that computer-use agents drive, as a toolkit layer on
top of the ``debian`` image.

One definition (packages, files, start command, config), one consumer: the built-in recipe
``BUILTIN_IMAGES["desktop"]`` (:func:`dsec.layers.builtin.build_desktop_layer`). The image is
two layers, ``debian``'s own layer (shared with every ``debian`` sandbox on the node: one
mount, one page cache) and the desktop toolkit layer: what ``apt-get install
--no-install-recommends`` of :data:`APT_PACKAGES` and :func:`apply_steps` change on top of it,
captured as an overlay upper directory (whiteouts and all, see :mod:`dsec.layers.overlay_build`).

What it has, all from Debian bookworm:

* the X server ``Xvfb`` (software, no GPU), ``xdpyinfo``/``xprop``/``xwininfo``, ``xrandr``;
* an Xfce session (``xfce4-session``, ``xfwm4``, ``xfdesktop``, ``xfce4-panel``, Thunar,
  ``xfce4-terminal``) on a session bus of its own, and ``xterm`` (a terminal that starts in
  seconds in a TCG guest, where GTK programs take tens of seconds);
* the input and query tools the display API and e2b-desktop run: ``xdotool``, ``scrot``,
  ``wmctrl``, ``xdg-open`` (``xdg-utils``), ``gtk-launch``, ``netstat``, ``pgrep``;
* ``x11vnc`` and noVNC/websockify (``/opt/noVNC`` is Debian's ``/usr/share/novnc``, where
  e2b-desktop's ``stream.start()`` looks) for a live view on port :data:`NOVNC_PORT`;
* Chromium as the browser (``x-www-browser`` and the ``text/html``/``http``/``https``
  handler of ``xdg-open``).

The user is E2B's: ``user`` (uid 1000, home ``/home/user``), the image's default user and
working directory (``debian``'s ``sandbox`` user is renamed).

The start command (:data:`START_CMD`, ``/usr/local/bin/dsec-desktop``) runs the X server on
:data:`DISPLAY` at :data:`GEOMETRY` (``DSEC_DESKTOP_GEOMETRY``, ``DSEC_DESKTOP_DPI`` change it;
``DSEC_DESKTOP_VNC=1`` also starts x11vnc and noVNC), a session bus at a fixed address (the
image's ``DBUS_SESSION_BUS_ADDRESS``, so commands run through exec reach the desktop's bus),
the window manager and, once it manages the screen, the rest of the Xfce session, and
stays in the foreground while the X server lives. The creation returns once the X server
answers and the window manager manages windows (:data:`READY_CMD`).

What an idle desktop runs, and what it does not: Xvfb without GLX, the session bus,
xfconfd, xfwm4, xfsettingsd, one panel whose plugins all run inside it, xfdesktop with a
plain background and no icons (so no Thunar daemon); x11vnc and noVNC only when a stream
is asked for. About 60 MiB of private memory per desktop, half what Debian's default
session takes. Its start blocks on events (Xvfb's ``-displayfd``, the bus's
``--print-address``, the root window's properties), never on poll loops: in a TCG guest a
poll loop's forks take the CPU the desktop needs to start.
If the X server dies, the start command ends (the sandbox's logs say why) and display calls
raise ``DisplayNotRunning`` until ``sb.display.restart()``.

e2b-desktop runs ``Xvfb :0 ...`` and ``startxfce4`` itself when it creates a sandbox; the
image's ``/usr/local/bin/Xvfb`` and ``/usr/local/bin/startxfce4`` (first on ``PATH``) adopt
the desktop already running on that display instead of starting a second one (a different
resolution restarts the desktop at it) and hand over to Debian's programs on any other
display.

The image config's label :data:`DISPLAY_LABEL` tells the edge that sandboxes of the image
(and of images built on it: labels are inherited) have a desktop on that display; dsec's
display API then drives it through the sandbox's exec (:mod:`dsec.edge.desktop`), on every
tier.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dsec.layers.users import RenameUser, rename_user

__all__ = [
    "APT_PACKAGES",
    "BASE_IMAGE",
    "CHROOT_COMMANDS",
    "DISPLAY",
    "DISPLAY_LABEL",
    "DPI",
    "ENV",
    "FILES",
    "GEOMETRY",
    "HOME",
    "IMAGE_NAME",
    "NOVNC_PORT",
    "READY_CMD",
    "START_CMD",
    "STATE_DIR",
    "USER",
    "VNC_PORT",
    "apply_steps",
    "image_meta",
    "recipe_fingerprint",
]

IMAGE_NAME = "desktop"
BASE_IMAGE = "debian"
"""The built-in image under the desktop layer."""
DISPLAY = ":0"
DISPLAY_LABEL = "dsec.display"
"""Image config label naming the X display of the image's desktop (``:0``)."""
GEOMETRY = "1024x768x24"
"""Default screen: width x height x depth (``DSEC_DESKTOP_GEOMETRY`` overrides it)."""
DPI = 96
USER = "user"
HOME = "/home/user"
VNC_PORT = 5900
NOVNC_PORT = 6080
STATE_DIR = "/tmp/.dsec-desktop"
"""The desktop's run-time state: ``<n>/`` per display (pids, geometry, the session bus)."""

APT_PACKAGES: tuple[str, ...] = (
    # X server and X utilities
    "xvfb",
    "x11-utils",
    "x11-xserver-utils",
    "x11-xkb-utils",
    "xkb-data",
    "xfonts-base",
    "xauth",
    # the Xfce session
    "xfce4-session",
    "xfwm4",
    "xfdesktop4",
    "xfce4-panel",
    "xfce4-settings",
    "xfconf",
    "thunar",
    "xfce4-terminal",
    "xterm",
    "dbus",
    "dbus-x11",
    "adwaita-icon-theme",
    # what the display API and e2b-desktop run
    "xdotool",
    "scrot",
    "wmctrl",
    "xdg-utils",
    "libgtk-3-bin",
    "desktop-file-utils",
    "shared-mime-info",
    "file",
    "net-tools",
    "procps",
    # the live view
    "x11vnc",
    "novnc",
    "websockify",
    "python3-websockify",
    # the browser
    "chromium",
    "fonts-dejavu-core",
    "ca-certificates",
)
"""Debian bookworm packages of the desktop layer (installed without recommends)."""

ENV: dict[str, str] = {
    "DISPLAY": DISPLAY,
    "DBUS_SESSION_BUS_ADDRESS": f"unix:path={STATE_DIR}/0/bus",
    "XDG_CURRENT_DESKTOP": "XFCE",
    "DESKTOP_SESSION": "xfce",
    "LANG": "C.UTF-8",
}
"""Environment of the image: every command finds the display and the desktop's bus."""

_SUPERVISOR = r"""#!/bin/bash
# dsec-desktop: the start command of dsec's desktop image (dsec.layers.desktop).
#
# Runs Xvfb on $DISPLAY (default :0) at $DSEC_DESKTOP_GEOMETRY (WxHxDEPTH, default
# 1024x768x24) and $DSEC_DESKTOP_DPI, a session bus at unix:path=/tmp/.dsec-desktop/<n>/bus,
# the Xfce session and, with DSEC_DESKTOP_VNC=1, x11vnc (5900) and noVNC (6080). Stays in
# the foreground while the X server runs. The X server is restarted only when asked (the
# image's Xvfb wrapper writes <state>/request "GEOMETRY DPI" and stops it); if it dies on
# its own this exits 1.
set -u
# a tier that starts commands with HOME=/root for every user: the user's own home
if [ "$(id -u)" != 0 ] && [ ! -w "${HOME:-/nonexistent}" ]; then
    HOME=$(getent passwd "$(id -u)" | cut -d: -f6)
    export HOME
fi
display=${DISPLAY:-:0}
export DISPLAY=$display
n=${display#:}
n=${n%%.*}
root=/tmp/.dsec-desktop
state=$root/$n
geometry=${DSEC_DESKTOP_GEOMETRY:-1024x768x24}
dpi=${DSEC_DESKTOP_DPI:-96}
mkdir -p /tmp/.X11-unix /tmp/.ICE-unix "$root" 2>/dev/null
chmod 1777 /tmp/.X11-unix /tmp/.ICE-unix "$root" 2>/dev/null
mkdir -p "$state" || { echo "dsec-desktop: cannot make $state" >&2; exit 1; }
export DBUS_SESSION_BUS_ADDRESS="unix:path=$state/bus"
echo $$ > "$state/supervisor.pid"
pgid=$(ps -o pgid= -p $$ | tr -d ' ')

# every process this script started except itself (they share its process group)
sweep() {
    local p
    for p in $(pgrep -g "$pgid"); do [ "$p" != $$ ] && kill -"$1" "$p" 2>/dev/null; done
}
stop() {
    sweep TERM
    sleep 0.2
    sweep KILL
    rm -f "$state/supervisor.pid" "$state/xvfb.pid" "$state/bus"
}
trap 'stop; exit 143' TERM INT HUP

while :; do
    if [ -f "$state/request" ]; then
        read -r geometry dpi < "$state/request"
        rm -f "$state/request"
    fi
    rm -f "$state/bus" "$state/ready" "$state/xready" "$state/busready"
    # Xvfb writes the display number to fd 3 (a fifo) once it accepts clients: no polling.
    # No GLX: Mesa's llvmpipe would cost every X client that probes GLX ~9 MB and its start
    # time (Chromium renders in software without it).
    mkfifo "$state/xready"
    /usr/bin/Xvfb "$display" -screen 0 "$geometry" -dpi "$dpi" -ac -nolisten tcp -s 0 \
        -extension GLX -displayfd 3 3> "$state/xready" > "$state/xvfb.log" 2>&1 &
    xpid=$!
    echo $xpid > "$state/xvfb.pid"
    up=0
    if read -r -t 120 _ < "$state/xready" && xdpyinfo > /dev/null 2>&1; then up=1; fi
    rm -f "$state/xready"
    if [ $up = 0 ]; then
        echo "dsec-desktop: Xvfb did not start on $display:" >&2
        tail -n 20 "$state/xvfb.log" >&2
        stop
        exit 1
    fi
    echo "$geometry" > "$state/geometry"
    echo "$dpi" > "$state/dpi"
    # the bus prints its address once it listens (every wait here blocks on an event, none
    # polls: in a TCG guest a poll loop's forks take the CPU the desktop needs to start)
    mkfifo "$state/busready"
    dbus-daemon --session --nofork --nopidfile --address="$DBUS_SESSION_BUS_ADDRESS" \
        --print-address=3 3> "$state/busready" > "$state/dbus.log" 2>&1 &
    read -r -t 60 _ < "$state/busready"
    rm -f "$state/busready"
    # the window manager first and on its own: the desktop is ready once it manages
    # windows (~0.2 s; started beside the rest of the session it competes with four GTK
    # programs for the CPU and takes seconds). xprop -spy prints the root window's
    # properties as they change, _NET_SUPPORTING_WM_CHECK (what wmctrl -m reads) when the
    # window manager sets it (all of them: a fresh X server has no such atom to name yet;
    # line-buffered: its stdout is a pipe).
    # Then the rest of the session (settings, panel, background); what startxfce4's
    # xinitrc would add (xrdb, xmodmap of files the image does not have) is not needed.
    exec 4< <(exec stdbuf -oL xprop -root -spy 2> /dev/null)
    spy=$!
    xfwm4 --sm-client-disable > "$state/wm.log" 2>&1 &
    while read -r -t 600 -u 4 line; do
        case $line in "_NET_SUPPORTING_WM_CHECK(WINDOW): window id #"*) break ;; esac
    done
    kill $spy 2> /dev/null
    exec 4<&-
    : > "$state/ready"
    XDG_MENU_PREFIX=xfce- xfce4-session > "$state/session.log" 2>&1 &
    if [ "${DSEC_DESKTOP_VNC:-0}" = 1 ]; then
        x11vnc -display "$display" -forever -shared -wait 50 -rfbport 5900 -nopw -quiet \
            > "$state/x11vnc.log" 2>&1 &
        (cd /opt/noVNC/utils && exec ./novnc_proxy --vnc localhost:5900 --listen 6080 \
            --web /opt/noVNC > "$state/novnc.log" 2>&1) &
    fi
    echo "dsec-desktop: X server on $display (${geometry}, ${dpi} dpi), Xfce starting"
    wait $xpid
    status=$?
    sweep TERM
    sleep 0.1
    sweep KILL
    if [ -f "$state/request" ]; then
        echo "dsec-desktop: restarting the desktop at $(cat "$state/request")"
        continue
    fi
    echo "dsec-desktop: the X server on $display exited (status $status):" >&2
    tail -n 20 "$state/xvfb.log" >&2
    rm -f "$state/supervisor.pid" "$state/xvfb.pid" "$state/bus"
    exit 1
done
"""

_XVFB_WRAPPER = r"""#!/bin/sh
# Xvfb of dsec's desktop image (dsec.layers.desktop). On the display the image's desktop
# runs on (dsec-desktop, its start command) this adopts that desktop: asked for another
# screen size or dpi it restarts the desktop at them and waits until it is up again, else
# it does nothing; both exit 0. On any other display it is Debian's Xvfb.
display=""
geometry=""
dpi=""
prev=""
for a in "$@"; do
    case "$prev" in
        -screen) prev=-screen-n; continue ;;
        -screen-n) geometry=$a ;;
        -dpi) dpi=$a ;;
    esac
    case "$a" in :[0-9]*) [ -z "$display" ] && display=$a ;; esac
    prev=$a
done
n=${display#:}
n=${n%%.*}
state=/tmp/.dsec-desktop/$n
if [ -n "$display" ] && [ -f "$state/supervisor.pid" ] \
    && kill -0 "$(cat "$state/supervisor.pid")" 2>/dev/null; then
    current=$(cat "$state/geometry" 2>/dev/null)
    current_dpi=$(cat "$state/dpi" 2>/dev/null)
    want=${geometry:-$current}
    want_dpi=${dpi:-$current_dpi}
    if [ "$want" = "$current" ] && [ "$want_dpi" = "$current_dpi" ]; then
        echo "Xvfb: $display is the desktop of this sandbox ($current, $current_dpi dpi)" >&2
        exit 0
    fi
    echo "$want $want_dpi" > "$state/request"
    kill "$(cat "$state/xvfb.pid")" 2>/dev/null
    i=0
    while [ $i -lt 600 ]; do
        if [ ! -f "$state/request" ] && [ "$(cat "$state/geometry" 2>/dev/null)" = "$want" ] \
            && DISPLAY=$display xdpyinfo > /dev/null 2>&1; then
            echo "Xvfb: restarted the desktop on $display at $want, $want_dpi dpi" >&2
            exit 0
        fi
        i=$((i + 1))
        sleep 0.05
    done
    echo "Xvfb: the desktop on $display did not come back at $want" >&2
    exit 1
fi
exec /usr/bin/Xvfb "$@"
"""

_STARTXFCE4_WRAPPER = r"""#!/bin/sh
# startxfce4 of dsec's desktop image (dsec.layers.desktop): on the display whose desktop the
# image's start command runs, the Xfce session is already there (or starting): wait for it
# and exit 0 instead of starting a second one. Elsewhere, Xfce's own startxfce4.
display=${DISPLAY:-}
n=${display#:}
n=${n%%.*}
state=/tmp/.dsec-desktop/$n
if [ -n "$display" ] && [ -f "$state/supervisor.pid" ] \
    && kill -0 "$(cat "$state/supervisor.pid")" 2>/dev/null; then
    i=0
    while [ $i -lt 600 ]; do
        if pgrep -x xfce4-session > /dev/null && pgrep -x xfwm4 > /dev/null; then
            echo "startxfce4: the desktop's Xfce session runs on $display" >&2
            exit 0
        fi
        i=$((i + 1))
        sleep 0.05
    done
    echo "startxfce4: no Xfce session appeared on $display" >&2
    exit 1
fi
exec /usr/bin/startxfce4 "$@"
"""

_CHROMIUM_FLAGS = r"""# dsec desktop image (dsec.layers.desktop). Chromium's own sandbox needs user namespaces,
# which a dsec sandbox refuses (the sandbox is the isolation boundary): without them, and
# as root, it runs without its inner sandbox. No first-run dialogs, no keyring prompts, no
# background traffic.
if [ "$(id -u)" = 0 ] || ! unshare --user true 2>/dev/null; then
    export CHROMIUM_FLAGS="$CHROMIUM_FLAGS --no-sandbox --test-type"
fi
export CHROMIUM_FLAGS="$CHROMIUM_FLAGS --no-first-run --password-store=basic --disable-background-networking --disable-component-update --disable-sync --disable-features=Translate,MediaRouter"
"""

_MIMEAPPS = """[Default Applications]
text/html=chromium.desktop
application/xhtml+xml=chromium.desktop
x-scheme-handler/http=chromium.desktop
x-scheme-handler/https=chromium.desktop
x-scheme-handler/about=chromium.desktop
application/pdf=chromium.desktop
"""

_XFWM4 = """<?xml version="1.0" encoding="UTF-8"?>
<channel name="xfwm4" version="1.0">
  <property name="general" type="empty">
    <property name="use_compositing" type="bool" value="false"/>
    <property name="workspace_count" type="int" value="1"/>
    <property name="cycle_preview" type="bool" value="false"/>
  </property>
</channel>
"""

_XFCE4_SESSION = """<?xml version="1.0" encoding="UTF-8"?>
<!-- dsec desktop image: Debian's failsafe session without the window manager (dsec-desktop
     starts xfwm4 itself, first) and without the Thunar daemon (it costs ~6 MB per desktop;
     Thunar still starts on demand), no session saving -->
<channel name="xfce4-session" version="1.0">
  <property name="general" type="empty">
    <property name="FailsafeSessionName" type="string" value="Failsafe"/>
    <property name="LockCommand" type="string" value=""/>
    <property name="SaveOnExit" type="bool" value="false"/>
    <property name="AutoSave" type="bool" value="false"/>
    <property name="PromptOnLogout" type="bool" value="false"/>
  </property>
  <property name="sessions" type="empty">
    <property name="Failsafe" type="empty">
      <property name="IsFailsafe" type="bool" value="true"/>
      <property name="Count" type="int" value="3"/>
      <property name="Client0_Command" type="array">
        <value type="string" value="xfsettingsd"/>
      </property>
      <property name="Client0_Priority" type="int" value="20"/>
      <property name="Client0_PerScreen" type="bool" value="false"/>
      <property name="Client1_Command" type="array">
        <value type="string" value="xfce4-panel"/>
      </property>
      <property name="Client1_Priority" type="int" value="25"/>
      <property name="Client1_PerScreen" type="bool" value="false"/>
      <property name="Client2_Command" type="array">
        <value type="string" value="xfdesktop"/>
      </property>
      <property name="Client2_Priority" type="int" value="35"/>
      <property name="Client2_PerScreen" type="bool" value="false"/>
    </property>
  </property>
</channel>
"""

_XFCE4_DESKTOP = """<?xml version="1.0" encoding="UTF-8"?>
<!-- dsec desktop image: a plain dark-blue background and no desktop icons (Debian's SVG
     wallpaper is rendered at every start, the icons start Thunar's daemon) -->
<channel name="xfce4-desktop" version="1.0">
  <property name="desktop-icons" type="empty">
    <property name="style" type="int" value="0"/>
  </property>
  <property name="backdrop" type="empty">
    <property name="screen0" type="empty">
      <property name="monitorscreen" type="empty">
        <property name="workspace0" type="empty">
          <property name="color-style" type="int" value="0"/>
          <property name="image-style" type="int" value="0"/>
          <property name="rgba1" type="array">
            <value type="double" value="0.121569"/>
            <value type="double" value="0.231373"/>
            <value type="double" value="0.364706"/>
            <value type="double" value="1.000000"/>
          </property>
        </property>
      </property>
    </property>
  </property>
</channel>
"""

_XFCE4_PANEL = """<?xml version="1.0" encoding="UTF-8"?>
<!-- dsec desktop image: one panel at the top with Debian's default plugins that run inside
     the panel (menu, window buttons, workspaces, clock, show desktop); the plugins that
     run as processes of their own (status tray, action buttons: ~5 MB each per desktop)
     and the launcher dock are left out -->
<channel name="xfce4-panel" version="1.0">
  <property name="configver" type="int" value="2"/>
  <property name="panels" type="array">
    <value type="int" value="1"/>
    <property name="dark-mode" type="bool" value="true"/>
    <property name="panel-1" type="empty">
      <property name="position" type="string" value="p=6;x=0;y=0"/>
      <property name="length" type="uint" value="100"/>
      <property name="position-locked" type="bool" value="true"/>
      <property name="icon-size" type="uint" value="16"/>
      <property name="size" type="uint" value="26"/>
      <property name="plugin-ids" type="array">
        <value type="int" value="1"/>
        <value type="int" value="2"/>
        <value type="int" value="3"/>
        <value type="int" value="4"/>
        <value type="int" value="5"/>
        <value type="int" value="6"/>
      </property>
    </property>
  </property>
  <property name="plugins" type="empty">
    <property name="plugin-1" type="string" value="applicationsmenu"/>
    <property name="plugin-2" type="string" value="tasklist">
      <property name="grouping" type="uint" value="1"/>
    </property>
    <property name="plugin-3" type="string" value="separator">
      <property name="expand" type="bool" value="true"/>
      <property name="style" type="uint" value="0"/>
    </property>
    <property name="plugin-4" type="string" value="pager"/>
    <property name="plugin-5" type="string" value="clock"/>
    <property name="plugin-6" type="string" value="showdesktop"/>
  </property>
</channel>
"""

_READY = r"""#!/bin/bash
# dsec-desktop-ready: the readiness check of dsec's desktop image (dsec.layers.desktop).
# Exits 0 once the X server on $DISPLAY answers and a window manager manages it. While the
# start command runs (its pid file exists) it first waits up to 8 s for the start
# command's ready mark, without a fork per tick (read -t on a fifo nobody writes: a TCG
# guest's CPU goes to the desktop, not to this wait).
display=${DISPLAY:-:0}
n=${display#:}
n=${n%%.*}
s=/tmp/.dsec-desktop/$n
if [ ! -e "$s/ready" ] && [ -e "$s/supervisor.pid" ]; then
    tick=$s/tick.$$
    if mkfifo "$tick" 2> /dev/null; then
        exec 5<> "$tick"
        rm -f "$tick"
        i=0
        while [ ! -e "$s/ready" ] && [ -e "$s/supervisor.pid" ] && [ $i -lt 400 ]; do
            read -r -t 0.02 -u 5 _
            i=$((i + 1))
        done
        exec 5<&-
    fi
fi
xdpyinfo > /dev/null 2>&1 && wmctrl -m > /dev/null 2>&1
"""

FILES: dict[str, tuple[int, str]] = {
    "/usr/local/bin/dsec-desktop": (0o755, _SUPERVISOR),
    "/usr/local/bin/dsec-desktop-ready": (0o755, _READY),
    "/usr/local/bin/Xvfb": (0o755, _XVFB_WRAPPER),
    "/usr/local/bin/startxfce4": (0o755, _STARTXFCE4_WRAPPER),
    "/etc/chromium.d/dsec-desktop": (0o644, _CHROMIUM_FLAGS),
    "/etc/xdg/mimeapps.list": (0o644, _MIMEAPPS),
    "/etc/xdg/xfce4/xfconf/xfce-perchannel-xml/xfwm4.xml": (0o644, _XFWM4),
    "/etc/xdg/xfce4/xfconf/xfce-perchannel-xml/xfce4-session.xml": (0o644, _XFCE4_SESSION),
    "/etc/xdg/xfce4/xfconf/xfce-perchannel-xml/xfce4-desktop.xml": (0o644, _XFCE4_DESKTOP),
    "/etc/xdg/xfce4/panel/default.xml": (0o644, _XFCE4_PANEL),
}
"""Files the layer adds: path -> (mode, text)."""

SYMLINKS: dict[str, str] = {"/opt/noVNC": "/usr/share/novnc"}
"""Symlinks the layer adds: path -> target (e2b-desktop runs noVNC from ``/opt/noVNC``)."""

START_CMD: tuple[str, ...] = ("/usr/local/bin/dsec-desktop",)
READY_CMD = "/usr/local/bin/dsec-desktop-ready"
"""Ready: the X server answers on ``$DISPLAY`` and a window manager manages its windows.
The check (:data:`_READY`) first waits, up to 8 s while the start command runs, for the
start command's own ``ready`` mark, made when the window manager takes the screen: the
creation returns then, not at the edge's next poll."""
READY_TIMEOUT_S = 600.0
"""Longest wait for the desktop at creation, s. The container tier is ready in about a
second; the vm tier under TCG on a busy 2-core machine needs minutes for Xfce's window
manager. A desktop whose start command fails ends the wait at once, whatever this is."""


@dataclass(frozen=True)
class MakeDir:
    """Create ``path`` with ``mode`` (owned by root)."""

    path: str
    mode: int


Step = RenameUser | MakeDir

STEPS: tuple[Step, ...] = (
    RenameUser("sandbox", USER, HOME),
    MakeDir("/tmp/.X11-unix", 0o1777),
    MakeDir("/tmp/.ICE-unix", 0o1777),
    MakeDir(STATE_DIR, 0o1777),
)
"""What the layer does after the packages and the files, in order."""


CHROOT_COMMANDS: tuple[tuple[str, ...], ...] = (("fc-cache", "--system-only", "--force"),)
"""Commands run in the finished tree (chroot), last. Fontconfig's system caches: packages
that change font directories after fontconfig's trigger ran (``xfonts-base``'s
``fonts.dir``, the Type 1 fonts) leave caches that no longer match, and every desktop
would rescan those fonts at its first GTK program and write caches of its own (~0.6 s of
the window manager's start)."""


def _inside(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def apply_steps(root: Path) -> None:
    """Write :data:`FILES` and :data:`SYMLINKS` and run :data:`STEPS` in the tree at ``root``
    (after the packages are installed)."""
    for path, (mode, text) in FILES.items():
        target = _inside(root, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.write_text(text)
        os.chmod(target, mode)
    for path, dest in SYMLINKS.items():
        link = _inside(root, path)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(dest, link)
    for step in STEPS:
        if isinstance(step, RenameUser):
            rename_user(root, step)
        else:
            target = _inside(root, step.path)
            target.mkdir(parents=True, exist_ok=True)
            os.chmod(target, step.mode)


def recipe_fingerprint() -> str:
    """16 hex digits over everything the layer is made of: an image built from another
    recipe is rebuilt (``meta["recipe"]``)."""
    recipe = json.dumps(
        [
            BASE_IMAGE,
            list(APT_PACKAGES),
            {k: [m, t] for k, (m, t) in FILES.items()},
            SYMLINKS,
            [repr(s) for s in STEPS],
            [list(c) for c in CHROOT_COMMANDS],
            list(START_CMD),
            READY_CMD,
            READY_TIMEOUT_S,
            ENV,
            USER,
            HOME,
        ],
        sort_keys=True,
    )
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def image_meta() -> dict[str, object]:
    """Metadata recorded on the image: its config (env, user, working directory, ports, the
    display label), its start command with the readiness check, and the recipe fingerprint."""
    from dsec.images.config import ImageConfig, StartCommand

    config = ImageConfig(
        Env=[f"{k}={v}" for k, v in ENV.items()],
        User=USER,
        WorkingDir=HOME,
        ExposedPorts={f"{NOVNC_PORT}/tcp": {}, f"{VNC_PORT}/tcp": {}},
        Labels={DISPLAY_LABEL: DISPLAY},
    )
    start = StartCommand(cmd=list(START_CMD), ready_cmd=READY_CMD, ready_timeout_s=READY_TIMEOUT_S)
    return {
        "suite": "bookworm",
        "base": BASE_IMAGE,
        "include": list(APT_PACKAGES),
        "config": config.to_meta(),
        "start": start.to_meta(),
        "recipe": recipe_fingerprint(),
    }
