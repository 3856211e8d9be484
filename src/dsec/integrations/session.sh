# dsec persistent shell session: the in-sandbox half of dsec/integrations/_session.py.
#
# No server runs in the sandbox. `start` launches one long-lived bash (the "loop") in the
# background, reading command ids from a FIFO; every other call is one short exec of
# `wait`, which hands the loop a command (or terminal input, or a signal) and blocks until
# the command ends, new output appears, or a deadline passes.
#
# Session directory DIR (mode 700):
#   ctl   FIFO: command ids for the loop, one per line (held open read-write by the loop)
#   done  FIFO: "ID EXIT_CODE" lines written by the loop when a command ends ("ready PID"
#         once at start)
#   in    FIFO: the terminal's input (the pty's input in pty mode, the loop's stdin else)
#   out   file: everything the session printed, appended (the client keeps a byte offset)
#   cmd   the command text, sourced by the loop (so cd, export, functions, aliases and
#         shell options persist: the command runs in the loop shell itself)
#   pid, launcher, mode  the loop shell's pid (= its process group), the launcher's, pty|pipe
#   typed non-empty when terminal input was sent during the running command
#
# After each command the loop prints the end marker \036ID\037 to its stdout (through the
# terminal, so it lands in `out` after all of the command's output) and then "ID RC" to
# `done`.
#
# Usage (argv of the exec):  bash session.sh start DIR auto|on|off
#                            bash session.sh loop DIR
#                            bash session.sh wait DIR MODE ID TIMEOUT_MS OFFSET KNOWN POLL CAP
# wait prints "DSEC STATUS RC MARKER_POS SIZE" ("-" for what it does not know) and then,
# for done/output/idle/dead, the bytes of `out` from OFFSET (at most CAP) in base64. MODE is
# one of run (stdin: the command), input (stdin: text for the terminal), wait, intr
# (SIGINT to the loop's process group), kill (SIGKILL to every process of that group but
# the loop), find (the end marker's offset, when the output was cut), close.

_now_us() {
    if [[ -n ${EPOCHREALTIME-} ]]; then
        _now=${EPOCHREALTIME/[.,]/}
    else
        _now=$(($(date +%s%N) / 1000))
    fi
}

_start() {
    local d=$1 want=$2 mode launcher word pid
    chmod 700 "$d" || return 1
    mkfifo -m 600 "$d/ctl" "$d/done" "$d/in" || return 1
    : >"$d/out"
    if [[ $want != off ]] && command -v script >/dev/null 2>&1; then
        mode=pty
    elif [[ $want == on ]]; then
        echo "DSEC failed - - 0"
        echo "a terminal was asked for but util-linux 'script' is not in the image" >&2
        return 0
    else
        mode=pipe
    fi
    # job control: the background job gets its own process group and keeps SIGINT
    # (a plain `&` in a script would start it with SIGINT ignored)
    set -m
    if [[ $mode == pty ]]; then
        # script(1) gives the loop a pseudo-terminal (its stdin, stdout and stderr):
        # programs see a tty, as under SWE-ReX's pexpect
        script -qfc "exec bash --norc --noprofile '$d/session.sh' loop '$d'" /dev/null \
            <>"$d/in" >>"$d/out" 2>&1 &
    else
        bash --norc --noprofile "$d/session.sh" loop "$d" <>"$d/in" >>"$d/out" 2>&1 &
    fi
    launcher=$!
    set +m
    echo "$launcher" >"$d/launcher"
    echo "$mode" >"$d/mode"
    : >"$d/typed"
    exec 4<>"$d/done"
    if IFS=' ' read -r -t 30 word pid <&4 && [[ $word == ready ]]; then
        echo "DSEC started $mode - 0"
    else
        echo "DSEC failed - - 0"
        tail -c 4096 "$d/out" >&2
    fi
}

_alive() { # process $1 exists and is not a zombie (its parent may reap it late)
    local stat
    read -r stat 2>/dev/null <"/proc/$1/stat" || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}

_kill_group() {  # SIGKILL every process in process group $1 except $1 itself
    local p stat rest
    for p in /proc/[0-9]*; do
        read -r stat <"$p/stat" 2>/dev/null || continue
        rest=${stat##*) }
        set -- "$1" $rest
        [[ $4 == "$1" && ${p#/proc/} != "$1" ]] && kill -KILL "${p#/proc/}" 2>/dev/null
    done
    return 0
}

_wait() {
    local d=$1 mode=$2 id=$3 timeout_ms=$4 off=$5 known=$6 poll=$7 cap=$8
    local pid launcher tmode status=timeout rc=- pos size step t did drc deadline i out
    read -r pid 2>/dev/null <"$d/pid" || {
        echo "DSEC dead - - -"
        return 0
    }
    read -r launcher 2>/dev/null <"$d/launcher"
    read -r tmode 2>/dev/null <"$d/mode"
    case $mode in
    run)
        # the shell is idle (the client's rule), so `cmd` is free to be rewritten
        cat >"$d/cmd" || return 1
        bash -n <"$d/cmd" >"$d/syntax.out" 2>"$d/syntax.err"
        i=$?
        if ((i != 0)); then
            echo "DSEC syntax $i - -"
            base64 <"$d/syntax.out"
            echo "DSEC-SEP"
            base64 <"$d/syntax.err"
            return 0
        fi
        printf '%s\n' "$id" >"$d/ctl"
        ;;
    input)
        echo 1 >"$d/typed" # the shell drains what the command leaves unread
        cat >"$d/in"
        ;;
    find) # where the end marker of $id is, from $off (when the output was cut at $cap)
        out=$(tail -c +$((off + 1)) "$d/out" | grep -abo -F -e $'\036'"$id"$'\037' | head -n 1)
        pos=${out%%:*}
        echo "DSEC found - ${pos:--} -"
        return 0
        ;;
    intr) kill -INT -- "-$pid" 2>/dev/null ;;
    kill)
        kill -INT "$pid" 2>/dev/null # the shell aborts the rest of the command (its trap)
        _kill_group "$pid"
        ;;
    close)
        kill -KILL -- "-$pid" 2>/dev/null
        [[ -n $launcher ]] && kill -KILL -- "-$launcher" 2>/dev/null
        rm -rf "$d"
        echo "DSEC closed - - -"
        return 0
        ;;
    esac
    if [[ $id == - ]]; then
        status=idle
        _alive "$pid" || status=dead
    else
        exec 4<>"$d/done"
        _now_us
        deadline=$((_now + timeout_ms * 1000))
        while :; do
            _now_us
            step=$((deadline - _now))
            ((step <= 0)) && break
            if [[ $poll == 1 ]]; then
                ((step > 50000)) && step=50000
            else
                ((step > 1000000)) && step=1000000
            fi
            printf -v t '%d.%06d' $((step / 1000000)) $((step % 1000000))
            if IFS=' ' read -r -t "$t" did drc <&4; then
                if [[ $did == "$id" ]]; then
                    status=done rc=$drc
                    break
                fi
                if [[ $did == __dsec_exit ]]; then # the shell ran `exit`
                    status=dead
                    break
                fi
                continue # the end of a command given up on earlier
            fi
            if ! _alive "$pid"; then
                status=dead
                break
            fi
            if [[ $poll == 1 ]]; then
                size=$(stat -c %s "$d/out" 2>/dev/null)
                if [[ $size != "$known" ]]; then
                    status=output
                    break
                fi
            fi
        done
    fi
    if [[ $status == done && $tmode == pty ]]; then
        # the end marker passes through the terminal: it may land a moment after the done
        # line (on pipes the shell wrote it to `out` before the done line)
        for ((i = 0; i < 1000; i++)); do
            tail -c +$((off + 1)) "$d/out" | grep -aqF -e $'\036'"$id"$'\037' && break
            read -r -t 0.003 _ <&4 # a sleep without a fork (nothing else comes for $id)
        done
    fi
    echo "DSEC $status $rc - ${size:--}"
    case $status in
    done | output | idle | dead) tail -c +$((off + 1)) "$d/out" | head -c "$cap" | base64 ;;
    esac
    return 0
}

case $1 in
start) _start "$2" "$3" ;;
wait) shift && _wait "$@" ;;
loop)
    # The loop runs at the top level of this script, not in a function: commands sourced
    # here see no positional parameters and `declare` makes globals, as at a prompt.
    __dsec_d=$2
    set --
    unset -f _now_us _start _alive _kill_group _wait
    exec 3<>"$__dsec_d/ctl" 4<>"$__dsec_d/done"
    if [[ -t 0 ]]; then
        stty -echo rows 24 cols 80 2>/dev/null
    fi
    shopt -s expand_aliases
    set +o history +o histexpand 2>/dev/null
    # SIGINT (an interrupt) stops the command being sourced, as Ctrl-C does at an
    # interactive prompt; between commands it does nothing
    trap '[[ -n $__dsec_busy ]] && return 130' INT
    __dsec_status() { return "$1"; }
    trap 'printf "__dsec_exit %s\n" "$?" >&4' EXIT
    __dsec_rc=0
    echo "$$" >"$__dsec_d/pid"
    echo "ready $$" >&4
    while :; do
        IFS= read -r __dsec_id <&3 || continue
        __dsec_busy=1
        __dsec_status "$__dsec_rc" # $? in the command: the previous command's status
        . "$__dsec_d/cmd"
        __dsec_rc=$?
        __dsec_busy=
        if ((__dsec_rc > 128)); then
            # after the INT trap returned from the sourced command, bash (5.2) runs no
            # further INT trap until it next forks a child: fork one
            (:)
        fi
        if [[ -s $__dsec_d/typed ]]; then # something was typed into the terminal
            # what the finished command did not read is not for the next one
            IFS= read -r -s -t 0.002 -N 65536 __dsec_junk
            : >"$__dsec_d/typed"
            if [[ -t 0 ]]; then
                stty -echo 2>/dev/null # the program (a REPL) may have turned echo back on
            fi
        fi
        printf '\036%s\037' "$__dsec_id"
        printf '%s %s\n' "$__dsec_id" "$__dsec_rc" >&4
    done
    ;;
*) echo "usage: session.sh start|loop|wait ..." >&2 && exit 2 ;;
esac
