/*
 * dsec guest agent: PID 1 of a dsec microVM / VM, serving the host over one virtio-serial port.
 *
 * Started by /init (see init.sh) after the sandbox root is assembled at /newroot. It opens the
 * virtio-serial port named "agent", unlinks every /dev/vport* node (the port is also exclusive:
 * virtio_console refuses a second open with EBUSY, so guest processes cannot open or forge the
 * channel), keeps fds to the initramfs busybox and the writable-layer tmpfs, builds the
 * commands' namespaces (below), enters the sandbox root and serves requests until the VM is
 * killed.
 *
 * The guard (docs/design/microvm.md, "The guard"): nothing a command does may kill or stall
 * the agent. Commands run in a PID namespace of their own, whose init is a small reaper forked
 * from the agent ("dsec-nsinit"): the agent (PID 1 of the guest, which the kernel never
 * OOM-kills) has no pid there, so commands cannot signal, ptrace or even name it, and a
 * `kill -9 -1` ends their own processes only. By default (a sandbox without `full_guest`) each
 * command also gets the container tier's protections, from /dsec/guard.policy and
 * /dsec/guard.bpf (written by dsec.guest.guard): a mount namespace where the sandbox root is
 * the root mount (the initramfs is out of reach), /proc of their PID namespace with the
 * container's masked and read-only paths, a tmpfs /dev with the container's devices, /sys
 * read-only, the container's capability bounding set, rlimits, no_new_privs and seccomp
 * filter, and a Landlock domain per command (no command can open another's /proc/<pid>/mem).
 * A `full_guest` sandbox's commands run in a mount namespace that shows the whole guest
 * (devtmpfs /dev, /sys, every /proc file) with every capability and no filter; they still
 * share the PID namespace above. The agent itself lives in the mount namespace of the
 * sandbox's mode, so the file API sees what its commands see.
 *
 * Wire format (both directions, little endian):
 *   frame  = magic u32 ("DSA1") | payload_len u32 | request_id u32 | op u16 | nargs u16 | args
 *   arg    = len u32 | bytes
 * Requests (host -> guest) and replies (guest -> host) carry the same request_id. An exec
 * request is answered by any number of OUT frames and one EXIT frame (or one ERR frame).
 *
 * TCP streams (the port proxy, dsec.edge.ports): TCP_OPEN "port" "window" connects a socket
 * to 127.0.0.1:port in the guest (the guest's own loopback: nothing needs a network) and
 * answers OK (the request id is then the stream id) or ERR (errno, e.g. ECONNREFUSED). Both
 * ways are flow-controlled by windows: the guest sends TCP_DATA frames of what it read while
 * fewer than "window" bytes are unacknowledged, and reads on when the host sends TCP_ACK
 * "n" for what it consumed; the host sends TCP_DATA frames while fewer than the guest's
 * window (GUEST_WINDOW) are unacknowledged, and the guest acknowledges (TCP_ACK) what it
 * wrote to the socket. TCP_EOF: the socket's read side ended (or failed). TCP_SHUT: the host
 * is done sending (shutdown(SHUT_WR) once the buffered bytes are written). TCP_CLOSE from
 * the host ends the stream (it is always sent, so slots never leak); bytes still buffered
 * are written first, as close(2) would, for at most CLOSE_LINGER_MS.
 *
 * Host mode: `agent --launch <cgroup.procs file>... -- <program> <args>` writes its own pid to
 * each file, enables KSM merging for itself (prctl PR_SET_MEMORY_MERGE, inherited across exec;
 * not if the environment has DSEC_KSM=0)
 * and execs the program. The runtime uses it to start QEMU inside its cgroup from the first
 * instruction.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/netlink.h>
#include <linux/random.h>
#include <linux/sched.h> /* struct clone_args, CLONE_INTO_CGROUP, CLONE_NEW* */
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAGIC 0x31415344u /* "DSA1" */
#define MAX_FRAME (256u << 20)
#define MAX_EXECS 64
#define DRAIN_GRACE_MS 100

enum {
    OP_PING = 1,
    OP_SETUP = 2,
    OP_EXEC = 3,
    OP_SIGNAL = 4,
    OP_READ = 10,
    OP_WRITE = 11,
    OP_LIST = 12,
    OP_STAT = 13,
    OP_REMOVE = 14,
    OP_MKDIR = 15,
    OP_RENAME = 16,
    OP_TCP_OPEN = 20,
    OP_TCP_DATA = 21,
    OP_TCP_SHUT = 22,
    OP_TCP_CLOSE = 23,
    OP_TCP_ACK = 24,
    OP_TCP_EOF = 25,
    OP_AUDIT = 30,
    OP_OK = 100,
    OP_ERR = 101,
    OP_OUT = 102,
    OP_EXIT = 103,
};

#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#endif
#ifndef RNDRESEEDCRNG
#define RNDRESEEDCRNG _IO('R', 0x07)
#endif

struct arg {
    const char *p;
    uint32_t n;
};

struct exec_state {
    int used;
    uint32_t id;
    pid_t pid;
    int fd_out, fd_err, fd_in;
    char *stdin_buf;
    size_t stdin_len, stdin_off;
    uint64_t max_out, n_out, n_err;
    int trunc_out, trunc_err;
    int64_t start_ms, deadline_ms, exit_ms;
    int exited, status, timed_out;
    char cgroup[32];   /* leaf under the commands cgroup ("" if cgroups are unavailable) */
    long long oom_base; /* the leaf's memory.events oom_kill when the command got it */
};

static int port_fd = -1;
static int busybox_fd = -1;
static int upper_fd = -1;
static int cmd_cg_fd = -1; /* O_PATH fd of the commands cgroup (cgroup2, outside the chroot) */
static unsigned long exec_seq;
#define MAX_STALE_CGROUPS 256
static char stale_cgroups[MAX_STALE_CGROUPS][32]; /* leaves still holding background processes */
#define MAX_FREE_LEAVES 8
static struct {
    char name[32];
    long long oom_kills;
} free_leaves[MAX_FREE_LEAVES]; /* empty leaves of finished commands, for the next ones */
static int n_free_leaves;
static struct exec_state execs[MAX_EXECS];

/* TCP streams to the guest's loopback (the port proxy). */
#define MAX_STREAMS 256
#define STREAM_CHUNK 65536
#define GUEST_WINDOW (1u << 20) /* bytes the host may have in flight to one stream */
#define CLOSE_LINGER_MS 10000
struct tcp_stream {
    int used;
    uint32_t id;
    int fd;
    int connecting;         /* connect() in progress: OK/ERR not sent yet */
    int eof_sent;           /* the socket's read side ended (TCP_EOF sent) */
    int shut_wanted;        /* TCP_SHUT received: shutdown(SHUT_WR) once wbuf is empty */
    int64_t closing_ms;     /* TCP_CLOSE received with bytes still to write: freed once they
                               are written (as close(2) does) or at this deadline */
    uint64_t window;        /* host's window for guest -> host bytes */
    uint64_t unacked;       /* guest -> host bytes the host has not acknowledged */
    char *wbuf;             /* host -> guest bytes not written to the socket yet */
    size_t wlen, wcap;
};
static struct tcp_stream streams[MAX_STREAMS];

/* The guard (see the top of this file and "the guard" below). */
#define GUARD_POLICY "/dsec/guard.policy"
#define GUARD_BPF "/dsec/guard.bpf"
#define MAX_GUARD_PATHS 64
#define MAX_GUARD_DEVS 16
#define MAX_GUARD_RLIMITS 16
static uint64_t guard_caps; /* capabilities kept in a guarded command's bounding set */
static struct {
    int res;
    struct rlimit lim;
} guard_rlimits[MAX_GUARD_RLIMITS];
static int n_guard_rlimits;
static char *guard_masked[MAX_GUARD_PATHS], *guard_readonly[MAX_GUARD_PATHS], *guard_devs[MAX_GUARD_DEVS];
static int n_guard_masked, n_guard_readonly, n_guard_devs;
static struct sock_fprog guard_filter; /* the container tier's seccomp filter */
static int cap_last = 40;              /* /proc/sys/kernel/cap_last_cap */
static char guard_error[320] = "the guard was not set up"; /* why guarded commands cannot run ("": they can) */
static char policy_error[320] = "the guard policy was not read"; /* load_guard's error ("": none) */
static int full_guest;                 /* this sandbox's commands run without the guard (SETUP) */
static const char *sandbox_root = "/newroot";
static char *argv_area;      /* the agent's argv strings (nsinit shows its own name there) */
static size_t argv_area_len;
static int ns_ok;                      /* the agent and its commands live in the commands' namespaces */
static int root_mnt_fd = -1, root_pid_fd = -1;           /* the guest's own namespaces */
static int guard_mnt_fd = -1, full_mnt_fd = -1, cmd_pid_fd = -1; /* the commands' ones */
static pid_t nsinit_pid;                                /* init of the commands' PID namespace */
static int guest_proc_fd = -1;                          /* the guest's own /proc (all pids) */
static char cg_mount_opts[16];                          /* what the agent's cgroup2 mount took */
/* vm tier (dsec.tty=1): an interactive shell on tty1, the display's console, respawned */
static int tty_wanted;
static pid_t tty_pid;
static int64_t tty_started_ms, tty_respawn_ms, tty_delay_ms = 1000;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                struct pollfd pf = {fd, POLLOUT, 0};
                poll(&pf, 1, 100);
                continue;
            }
            return; /* host gone: drop */
        }
        p += w;
        n -= (size_t)w;
    }
}

/* Frames to the host are gathered in one buffer and written once per turn of the main loop
 * (out_flush before it waits), so a command's last output and its exit status reach the host
 * in one virtio-serial write: one host wake-up instead of two. */
static char *obuf;
static size_t olen, ocap;
#define OBUF_FLUSH_AT (256 * 1024)

static void out_flush(void) {
    if (olen > 0) write_all(port_fd, obuf, olen);
    olen = 0;
}

static void out_put(const void *p, size_t n) {
    if (olen + n > ocap) {
        out_flush();
        if (n > OBUF_FLUSH_AT) { /* too big to copy: straight through, order kept */
            write_all(port_fd, p, n);
            return;
        }
        if (!obuf) {
            ocap = 2 * OBUF_FLUSH_AT;
            obuf = malloc(ocap);
            if (!obuf) {
                ocap = 0;
                write_all(port_fd, p, n);
                return;
            }
        }
    }
    memcpy(obuf + olen, p, n);
    olen += n;
    if (olen >= OBUF_FLUSH_AT) out_flush();
}

static void frame_header(uint32_t id, uint16_t op, uint32_t payload, uint16_t nargs) {
    char hdr[16];
    uint32_t magic = MAGIC;
    memcpy(hdr, &magic, 4);
    memcpy(hdr + 4, &payload, 4);
    memcpy(hdr + 8, &id, 4);
    memcpy(hdr + 12, &op, 2);
    memcpy(hdr + 14, &nargs, 2);
    out_put(hdr, 16);
}

/* Queue one frame with up to 16 args. */
static void send_frame(uint32_t id, uint16_t op, int nargs, const struct arg *args) {
    uint32_t payload = 0;
    for (int i = 0; i < nargs; i++) payload += 4 + args[i].n;
    frame_header(id, op, payload, (uint16_t)nargs);
    for (int i = 0; i < nargs; i++) {
        out_put(&args[i].n, 4);
        out_put(args[i].p, args[i].n);
    }
}

static struct arg str_arg(const char *s) {
    struct arg a = {s, (uint32_t)strlen(s)};
    return a;
}

static void send_err(uint32_t id, int err, const char *what) {
    char code[16], msg[PATH_MAX + 128];
    snprintf(code, sizeof code, "%d", err);
    snprintf(msg, sizeof msg, "%s: %s", what, strerror(err));
    struct arg a[2] = {str_arg(code), str_arg(msg)};
    send_frame(id, OP_ERR, 2, a);
}

/* EINVAL "not a regular file" (the host's InvalidRequest). */
static void send_not_regular(uint32_t id, const char *path) {
    char code[16], msg[PATH_MAX + 64];
    snprintf(code, sizeof code, "%d", EINVAL);
    snprintf(msg, sizeof msg, "not a regular file: %s", path);
    struct arg a[2] = {str_arg(code), str_arg(msg)};
    send_frame(id, OP_ERR, 2, a);
}

static void send_ok(uint32_t id) { send_frame(id, OP_OK, 0, NULL); }

/* An argument parsed as an unsigned decimal (args are not NUL-terminated). */
static unsigned long long arg_num(const struct arg *a, unsigned long long dflt) {
    char buf[32];
    if (a->n == 0 || a->n >= sizeof buf) return dflt;
    memcpy(buf, a->p, a->n);
    buf[a->n] = 0;
    return strtoull(buf, NULL, 10);
}

/* NUL-terminated copy of an argument (caller frees). */
static char *arg_str(const struct arg *a) {
    char *s = malloc(a->n + 1);
    if (!s) return NULL;
    memcpy(s, a->p, a->n);
    s[a->n] = 0;
    return s;
}

/* ------------------------------------------------------------------ file entries */

/* entry = type u8 | size u64 | mode u32 | mtime_ns i64 | uid u32 | gid u32  (29 bytes) */
static void pack_entry(char out[29], const struct stat *st) {
    uint8_t type = S_ISREG(st->st_mode) ? 0 : S_ISDIR(st->st_mode) ? 1 : S_ISLNK(st->st_mode) ? 2 : 3;
    uint64_t size = (uint64_t)st->st_size;
    uint32_t mode = st->st_mode & 07777;
    int64_t mtime = (int64_t)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
    uint32_t uid = st->st_uid, gid = st->st_gid;
    out[0] = (char)type;
    memcpy(out + 1, &size, 8);
    memcpy(out + 9, &mode, 4);
    memcpy(out + 13, &mtime, 8);
    memcpy(out + 21, &uid, 4);
    memcpy(out + 25, &gid, 4);
}

struct entry_list {
    struct arg *args;
    char **owned;
    int n, cap;
};

static int list_push(struct entry_list *l, const char *path, const struct stat *st) {
    if (l->n + 3 > l->cap) {
        int cap = l->cap ? l->cap * 2 : 96;
        struct arg *na = realloc(l->args, sizeof(struct arg) * cap);
        if (!na) return -1;
        l->args = na;
        char **no = realloc(l->owned, sizeof(char *) * cap);
        if (!no) return -1;
        l->owned = no;
        l->cap = cap;
    }
    char *e = malloc(29);
    char *p = strdup(path);
    char target[PATH_MAX];
    ssize_t tn = 0;
    if (S_ISLNK(st->st_mode)) {
        tn = readlink(path, target, sizeof target - 1);
        if (tn < 0) tn = 0;
    }
    char *t = malloc((size_t)tn + 1);
    if (!e || !p || !t) return -1;
    memcpy(t, target, (size_t)tn);
    pack_entry(e, st);
    l->owned[l->n] = e;
    l->args[l->n++] = (struct arg){e, 29};
    l->owned[l->n] = p;
    l->args[l->n++] = (struct arg){p, (uint32_t)strlen(p)};
    l->owned[l->n] = t;
    l->args[l->n++] = (struct arg){t, (uint32_t)tn};
    return 0;
}

static void list_free(struct entry_list *l) {
    for (int i = 0; i < l->n; i++) free(l->owned[i]);
    free(l->args);
    free(l->owned);
}

/* send an entry list in frames of at most 3000 args (the host concatenates OK frames
 * flagged "more" via op OK with a trailing empty marker arg is avoided: we send it all) */
static void send_entries(uint32_t id, struct entry_list *l) {
    uint32_t payload = 0;
    for (int i = 0; i < l->n; i++) payload += 4 + l->args[i].n;
    uint32_t nargs = (uint32_t)l->n;
    uint16_t na = (uint16_t)(nargs > 65535 ? 65535 : nargs);
    frame_header(id, OP_OK, payload, na);
    for (int i = 0; i < (int)na; i++) {
        out_put(&l->args[i].n, 4);
        out_put(l->args[i].p, l->args[i].n);
    }
}

static int mkdir_p(const char *path, mode_t mode) {
    char buf[PATH_MAX];
    if (strlen(path) >= sizeof buf) return -ENAMETOOLONG;
    strcpy(buf, path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, mode) < 0 && errno != EEXIST) return -errno;
        *p = '/';
    }
    if (mkdir(buf, mode) < 0 && errno != EEXIST) return -errno;
    struct stat st;
    if (stat(buf, &st) < 0) return -errno;
    if (!S_ISDIR(st.st_mode)) return -ENOTDIR;
    return 0;
}

static void list_dir(struct entry_list *l, const char *path, int depth) {
    DIR *d = opendir(path);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        char child[PATH_MAX];
        int n = snprintf(child, sizeof child, "%s%s%s", path, path[strlen(path) - 1] == '/' ? "" : "/", de->d_name);
        if (n <= 0 || n >= (int)sizeof child) continue;
        struct stat st;
        if (lstat(child, &st) < 0) continue;
        if (list_push(l, child, &st) < 0) break;
        if (l->n >= 65535 - 3) break;
        if (depth > 1 && S_ISDIR(st.st_mode)) list_dir(l, child, depth - 1);
    }
    closedir(d);
}

static int rm_cb(const char *p, const struct stat *st, int flag, struct FTW *f) {
    (void)st;
    (void)f;
    return (flag == FTW_DP ? rmdir(p) : unlink(p)) < 0 ? -1 : 0;
}

static void reply_stat(uint32_t id, const char *path) {
    struct stat st;
    if (lstat(path, &st) < 0) {
        send_err(id, errno, path);
        return;
    }
    struct entry_list l = {0};
    if (list_push(&l, path, &st) < 0) {
        send_err(id, ENOMEM, path);
    } else {
        send_entries(id, &l);
    }
    list_free(&l);
}

/* 1 if `p` is absolute and has no ".." component. The host sends normalised paths; the agent
 * still refuses anything else so that no request can walk above a directory it names. */
static int path_ok(const char *p) {
    if (!p || p[0] != '/') return 0;
    for (const char *c = p; (c = strstr(c, "..")) != NULL; c += 2) {
        if (c[-1] == '/' && (c[2] == '/' || c[2] == 0)) return 0;
    }
    return 1;
}

static void do_file_op(uint32_t id, uint16_t op, int nargs, struct arg *a) {
    if (nargs < 1) {
        send_err(id, EINVAL, "missing path");
        return;
    }
    char *path = arg_str(&a[0]);
    char *path2 = NULL;
    if (!path) {
        send_err(id, ENOMEM, "alloc");
        return;
    }
    if (!path_ok(path) || strlen(path) != a[0].n) {
        send_err(id, EINVAL, "path must be absolute, without '..' or NUL");
        free(path);
        return;
    }
    switch (op) {
    case OP_READ: {
        uint64_t max = nargs > 1 ? arg_num(&a[1], 64u << 20) : (64u << 20);
        /* non-blocking: a FIFO (or /proc/kmsg) a command put where the host reads must not
         * hold the agent; only regular files are read, as on the container tier */
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) < 0) {
            send_err(id, errno, path);
            if (fd >= 0) close(fd);
            break;
        }
        if (!S_ISREG(st.st_mode)) {
            close(fd);
            if (S_ISDIR(st.st_mode))
                send_err(id, EISDIR, path);
            else
                send_not_regular(id, path);
            break;
        }
        size_t cap = 65536, len = 0;
        char *buf = malloc(cap);
        int err = 0;
        for (;;) {
            if (len == cap) {
                cap *= 2;
                char *nb = realloc(buf, cap);
                if (!nb) {
                    err = ENOMEM;
                    break;
                }
                buf = nb;
            }
            ssize_t r = read(fd, buf + len, cap - len);
            if (r < 0) {
                if (errno == EINTR) continue;
                err = errno;
                break;
            }
            if (r == 0) break;
            len += (size_t)r;
            if (len > max) {
                err = EFBIG;
                break;
            }
        }
        close(fd);
        if (err) {
            send_err(id, err, path);
        } else {
            struct arg out = {buf, (uint32_t)len};
            send_frame(id, OP_OK, 1, &out);
        }
        free(buf);
        break;
    }
    case OP_WRITE: {
        if (nargs < 4) {
            send_err(id, EINVAL, "write needs path, data, mode, parents");
            break;
        }
        mode_t mode = (mode_t)arg_num(&a[2], 0644) & 07777;
        if (a[3].n && a[3].p[0] == '1') {
            char *slash = strrchr(path, '/');
            if (slash && slash != path) {
                *slash = 0;
                int r = mkdir_p(path, 0755);
                *slash = '/';
                if (r < 0) {
                    send_err(id, -r, path);
                    break;
                }
            }
        }
        int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, mode);
        struct stat st;
        if (fd < 0 && errno == ENXIO) { /* a FIFO without a reader */
            send_not_regular(id, path);
            break;
        }
        if (fd < 0 || fstat(fd, &st) < 0) {
            send_err(id, errno, path);
            if (fd >= 0) close(fd);
            break;
        }
        if (!S_ISREG(st.st_mode)) {
            close(fd);
            send_not_regular(id, path);
            break;
        }
        if (ftruncate(fd, 0) < 0) {
            send_err(id, errno, path);
            close(fd);
            break;
        }
        size_t off = 0;
        int err = 0;
        while (off < a[1].n) {
            ssize_t w = write(fd, a[1].p + off, a[1].n - off);
            if (w < 0) {
                if (errno == EINTR) continue;
                err = errno;
                break;
            }
            off += (size_t)w;
        }
        if (!err && fchmod(fd, mode) < 0) err = errno;
        if (close(fd) < 0 && !err) err = errno;
        if (err) {
            send_err(id, err, path);
            break;
        }
        reply_stat(id, path);
        break;
    }
    case OP_STAT:
        reply_stat(id, path);
        break;
    case OP_LIST: {
        int depth = nargs > 1 ? (int)arg_num(&a[1], 1) : 1;
        struct stat st;
        if (stat(path, &st) < 0) {
            send_err(id, errno, path);
            break;
        }
        if (!S_ISDIR(st.st_mode)) {
            send_err(id, ENOTDIR, path);
            break;
        }
        struct entry_list l = {0};
        list_dir(&l, path, depth < 1 ? 1 : depth);
        send_entries(id, &l);
        list_free(&l);
        break;
    }
    case OP_REMOVE: {
        int recursive = nargs > 1 && a[1].n && a[1].p[0] == '1';
        struct stat st;
        if (lstat(path, &st) < 0) {
            send_err(id, errno, path);
            break;
        }
        int r;
        if (S_ISDIR(st.st_mode)) {
            r = recursive ? nftw(path, rm_cb, 32, FTW_DEPTH | FTW_PHYS) : rmdir(path);
        } else {
            r = unlink(path);
        }
        if (r < 0) {
            send_err(id, errno, path);
        } else {
            send_ok(id);
        }
        break;
    }
    case OP_MKDIR: {
        int parents = nargs > 1 && a[1].n && a[1].p[0] == '1';
        int r = parents ? mkdir_p(path, 0755) : (mkdir(path, 0755) < 0 ? -errno : 0);
        if (r < 0) {
            send_err(id, -r, path);
            break;
        }
        reply_stat(id, path);
        break;
    }
    case OP_RENAME: {
        if (nargs < 2) {
            send_err(id, EINVAL, "rename needs src, dst");
            break;
        }
        path2 = arg_str(&a[1]);
        if (path2 && (!path_ok(path2) || strlen(path2) != a[1].n)) {
            send_err(id, EINVAL, "path must be absolute, without '..' or NUL");
            break;
        }
        if (!path2 || rename(path, path2) < 0) {
            send_err(id, path2 ? errno : ENOMEM, path);
            break;
        }
        reply_stat(id, path2);
        break;
    }
    default:
        send_err(id, ENOSYS, "unknown op");
    }
    free(path);
    free(path2);
}

/* ------------------------------------------------------------------ guest cgroups
 *
 * Every command runs in its own leaf cgroup under /cgroup/cmd (cgroup2, mounted at the
 * initramfs root, under the sandbox root; guarded commands see the hierarchy read-only at
 * /sys/fs/cgroup, full guests can mount it themselves). The
 * "cmd" cgroup carries the sandbox's limits: pids.max (the create request's `pids`, set by
 * SETUP) and memory.max (guest RAM minus a reserve for the kernel and this agent), so a fork
 * bomb or a memory hog is stopped inside its cgroup instead of starving the agent. The leaf
 * tells whether the OOM killer hit the command (memory.events oom_kill) and lets a timeout
 * kill everything the command started (cgroup.kill), including setsid'ed children. */

static int cg_write(int dirfd, const char *file, const char *value) {
    int fd = openat(dirfd, file, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    ssize_t n = write(fd, value, strlen(value));
    int err = n < 0 ? -errno : 0;
    close(fd);
    return err;
}

/* The value of `key` in a flat-keyed cgroup file (memory.events), or -1. */
static long long cg_read_key(int dirfd, const char *file, const char *key) {
    int fd = openat(dirfd, file, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char buf[1024];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    size_t klen = strlen(key);
    for (char *line = buf; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (strncmp(line, key, klen) == 0 && line[klen] == ' ') return atoll(line + klen + 1);
    }
    return -1;
}

static long long mem_total_bytes(void) {
    FILE *f = fopen("/proc/meminfo", "re");
    if (!f) return -1;
    char line[256];
    long long kb = -1;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %lld kB", &kb) == 1) break;
    }
    fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

/* Mount cgroup2 at /cgroup (initramfs root, before the chroot) and make /cgroup/cmd. */
static void setup_cgroups(void) {
    mkdir("/cgroup", 0700);
    /* favordynmods: moving a process between cgroups (the fork() fallback of spawn_command)
     * does not wait for an RCU grace period */
    if (mount("cgroup2", "/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, "favordynmods") == 0) {
        /* every later mount of the hierarchy must pass it too: each mount sets its root flags */
        snprintf(cg_mount_opts, sizeof cg_mount_opts, "favordynmods");
    } else if (mount("cgroup2", "/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0 && errno != EBUSY) {
        fprintf(stderr, "dsec-agent: cgroup2: %s (commands run without limits)\n", strerror(errno));
        return;
    }
    int root = open("/cgroup", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0) return;
    cg_write(root, "cgroup.subtree_control", "+memory +pids");
    if (mkdirat(root, "cmd", 0700) < 0 && errno != EEXIST) {
        close(root);
        return;
    }
    cmd_cg_fd = openat(root, "cmd", O_PATH | O_DIRECTORY | O_CLOEXEC);
    close(root);
    if (cmd_cg_fd < 0) return;
    cg_write(cmd_cg_fd, "cgroup.subtree_control", "+memory +pids");
    long long total = mem_total_bytes();
    if (total > 0) {
        /* reserve for the kernel, page cache of the agent and the writable layer's metadata */
        long long reserve = total / 8;
        if (reserve < (12LL << 20)) reserve = 12LL << 20;
        if (reserve > (64LL << 20)) reserve = 64LL << 20;
        if (total > 2 * reserve) {
            char v[32];
            snprintf(v, sizeof v, "%lld", total - reserve);
            cg_write(cmd_cg_fd, "memory.max", v);
            cg_write(cmd_cg_fd, "memory.swap.max", "0");
        }
    }
}

/* Remove leaves whose background processes have exited since their command ended. */
static void sweep_stale_cgroups(void) {
    if (cmd_cg_fd < 0) return;
    for (int i = 0; i < MAX_STALE_CGROUPS; i++) {
        if (stale_cgroups[i][0] && unlinkat(cmd_cg_fd, stale_cgroups[i], AT_REMOVEDIR) == 0) stale_cgroups[i][0] = 0;
    }
}

static void release_cgroup(const char *name) {
    if (cmd_cg_fd < 0 || !name[0]) return;
    if (unlinkat(cmd_cg_fd, name, AT_REMOVEDIR) == 0) return;
    for (int i = 0; i < MAX_STALE_CGROUPS; i++) {
        if (!stale_cgroups[i][0]) {
            snprintf(stale_cgroups[i], sizeof stale_cgroups[i], "%s", name);
            return;
        }
    }
}

/* Whether a leaf holds processes (cgroup.events "populated"); unreadable counts as populated. */
static int leaf_populated(const char *name) {
    char p[64];
    snprintf(p, sizeof p, "%s/cgroup.events", name);
    return cg_read_key(cmd_cg_fd, p, "populated") != 0;
}

/* One command's share of the pids limit (pids.max of its leaf): the sandbox's limit less a
 * reserve (1/4, at most 8), so that a fork bomb a command left behind (setsid, daemonised: it
 * stays in its leaf) still leaves room for the next command, a `kill -9 -1` say. 0: no limit. */
static long long leaf_pids_max;

static void set_leaf_pids(const char *leaf) {
    char p[64], v[32];
    if (cmd_cg_fd < 0 || leaf_pids_max <= 0) return;
    snprintf(p, sizeof p, "%s/pids.max", leaf);
    snprintf(v, sizeof v, "%lld", leaf_pids_max);
    cg_write(cmd_cg_fd, p, v);
}

/* A leaf cgroup for a new command, in ``name`` ("" when none can be made): an empty one a
 * finished command left, else a new one. Reuse matters under TCG: a command's first charges
 * in a freshly made memory cgroup (and the teardown of the last one) cost ~10 ms there.
 * ``oom_base`` gets the leaf's oom_kill count so far. */
static void take_leaf(char *name, size_t len, long long *oom_base) {
    while (n_free_leaves > 0) {
        n_free_leaves--;
        snprintf(name, len, "%s", free_leaves[n_free_leaves].name);
        *oom_base = free_leaves[n_free_leaves].oom_kills;
        if (!leaf_populated(name)) return;
        release_cgroup(name); /* something joined it since: not reused */
    }
    *oom_base = 0;
    snprintf(name, len, "c%lu", ++exec_seq);
    if (mkdirat(cmd_cg_fd, name, 0700) < 0)
        name[0] = 0;
    else
        set_leaf_pids(name);
}

/* Give back a command's leaf for a later command. Whether it is empty is checked when it is
 * taken again (take_leaf), the moment that matters: one cgroup.events read per command. */
static void put_leaf(const char *name, long long oom_kills) {
    if (cmd_cg_fd < 0 || !name[0]) return;
    if (n_free_leaves < MAX_FREE_LEAVES) {
        snprintf(free_leaves[n_free_leaves].name, sizeof free_leaves[0].name, "%s", name);
        free_leaves[n_free_leaves++].oom_kills = oom_kills;
        return;
    }
    release_cgroup(name);
}

/* Kill every process of a command (its leaf cgroup, else its process group). */
static void kill_command(struct exec_state *e) {
    if (cmd_cg_fd >= 0 && e->cgroup[0]) {
        char p[64];
        snprintf(p, sizeof p, "%s/cgroup.kill", e->cgroup);
        cg_write(cmd_cg_fd, p, "1");
    }
    kill(-e->pid, SIGKILL);
    kill(e->pid, SIGKILL);
}

/* ------------------------------------------------------------------ the guard
 *
 * The commands' namespaces (built at boot, so every template clone has them, and again if
 * their init ever dies):
 *
 *   PID namespace P    init = "dsec-nsinit", forked from the agent with CLONE_NEWPID |
 *                      CLONE_NEWNS; it reaps orphans and nothing else. The agent stays in the
 *                      guest's own PID namespace and makes P the namespace of its children
 *                      (setns CLONE_NEWPID changes only pid_for_children), so every command is
 *                      born in P and reaped by the agent as before.
 *   mount namespace A  "full": a copy of the guest's with a procfs of P and the sandbox root
 *                      moved onto / (as switch_root does: the initramfs, its cgroup2 mount and
 *                      the layer disks lie under it, out of reach of any path). full_guest
 *                      sandboxes run here.
 *   mount namespace B  "guarded": a copy of A plus the container tier's masked and read-only
 *                      paths, a tmpfs /dev with its devices (+ /dev/pts, /dev/shm of A), /sys
 *                      read-only and the commands' cgroup2 read-only at /sys/fs/cgroup.
 *
 * nsinit builds A in its own (new) mount namespace, opens it, unshares B and builds that; the
 * agent opens both through /proc/<nsinit>/ (A by the fd nsinit keeps open) and setns()es into
 * the one of its sandbox's mode. Commands inherit the agent's mount namespace; a guarded
 * command additionally applies, in its child before execve: the rlimits, the capability
 * bounding set and capabilities, no_new_privs and the seccomp filter of the policy. */

#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif

/* Every guarded command enters a Landlock domain of its own (docs/design/tenancy.md): the
 * kernel lets a process open /proc/<pid>/mem (and ptrace) only of processes in its own domain
 * or one nested in it, so what one command leaves running cannot rewrite the memory of a
 * command started later (a grader) even as the same uid. The ruleset restricts nothing a
 * command may do: it handles only the making of block devices, which the guard forbids anyway.
 * -1: the kernel has no Landlock (the agent says so on the console). */
static int command_domain_fd = -1;
static int command_domain_refer = 0; /* the ruleset handles REFER (ABI 2+): granted per command */

/* From Landlock ABI 2 a domain refuses every link or rename across directories (EXDEV: apt,
 * pip, mv) unless its ruleset handles REFER and grants it: granted beneath ROOT_FD (the
 * root the commands see). */
static int add_refer_beneath_root(int ruleset_fd) {
    struct {
        uint64_t allowed_access;
        int32_t parent_fd;
    } __attribute__((packed)) rule;
    int root = open("/", O_PATH | O_CLOEXEC);
    if (root < 0) return -1;
    rule.allowed_access = 1ull << 13; /* LANDLOCK_ACCESS_FS_REFER (ABI 2) */
    rule.parent_fd = root;
    long rc = syscall(445 /* SYS_landlock_add_rule */, ruleset_fd, 1 /* PATH_BENEATH */, &rule, 0);
    close(root);
    return rc < 0 ? -1 : 0;
}

static int landlock_abi_version(void) {
    long v = syscall(SYS_landlock_create_ruleset, NULL, 0, 1 /* CREATE_RULESET_VERSION */);
    return v > 0 ? (int)v : 0;
}

static void make_command_domain(void) {
    int abi = landlock_abi_version();
    uint64_t handled_access_fs = 1ull << 11; /* LANDLOCK_ACCESS_FS_MAKE_BLOCK (ABI 1) */
    if (abi >= 2) handled_access_fs |= 1ull << 13; /* REFER, granted beneath / */
    long fd = syscall(SYS_landlock_create_ruleset, &handled_access_fs, sizeof handled_access_fs, 0);
    command_domain_refer = abi >= 2;
    if (fd < 0)
        fprintf(stderr, "dsec-agent: landlock: %s (commands are not kept out of each other's memory)\n",
                strerror(errno));
    else
        command_domain_fd = (int)fd;
}

/* Read the guard's policy and filter from the initramfs (before any namespace change). */
static void load_guard(void) {
    FILE *f = fopen(GUARD_POLICY, "re");
    if (!f) {
        snprintf(policy_error, sizeof policy_error, "no guard policy (%s: %s)", GUARD_POLICY, strerror(errno));
        return;
    }
    char line[PATH_MAX + 32], path[PATH_MAX];
    int ok = 1;
    while (ok && fgets(line, sizeof line, f)) {
        int n;
        long long soft, hard;
        line[strcspn(line, "\n")] = 0;
        if (line[0] == '#' || line[0] == 0) continue;
        if (sscanf(line, "cap %d", &n) == 1 && n >= 0 && n < 64) {
            guard_caps |= 1ull << n;
        } else if (sscanf(line, "rlimit %d %lld %lld", &n, &soft, &hard) == 3 && n_guard_rlimits < MAX_GUARD_RLIMITS) {
            guard_rlimits[n_guard_rlimits].res = n;
            guard_rlimits[n_guard_rlimits].lim.rlim_cur = soft < 0 ? RLIM_INFINITY : (rlim_t)soft;
            guard_rlimits[n_guard_rlimits].lim.rlim_max = hard < 0 ? RLIM_INFINITY : (rlim_t)hard;
            n_guard_rlimits++;
        } else if (sscanf(line, "mask %4095s", path) == 1 && n_guard_masked < MAX_GUARD_PATHS) {
            guard_masked[n_guard_masked++] = strdup(path);
        } else if (sscanf(line, "readonly %4095s", path) == 1 && n_guard_readonly < MAX_GUARD_PATHS) {
            guard_readonly[n_guard_readonly++] = strdup(path);
        } else if (sscanf(line, "dev %4095s", path) == 1 && n_guard_devs < MAX_GUARD_DEVS && !strchr(path, '/')) {
            guard_devs[n_guard_devs++] = strdup(path);
        } else {
            snprintf(policy_error, sizeof policy_error, "bad line in %s: %.200s", GUARD_POLICY, line);
            ok = 0;
        }
    }
    fclose(f);
    if (!ok) return;
    int fd = open(GUARD_BPF, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0 || st.st_size <= 0 || st.st_size % sizeof(struct sock_filter) ||
        st.st_size > (off_t)(BPF_MAXINSNS * sizeof(struct sock_filter))) {
        snprintf(policy_error, sizeof policy_error, "no usable seccomp filter in %s", GUARD_BPF);
        if (fd >= 0) close(fd);
        return;
    }
    struct sock_filter *prog = malloc((size_t)st.st_size);
    ssize_t n = prog ? read(fd, prog, (size_t)st.st_size) : -1;
    close(fd);
    if (n != st.st_size) {
        snprintf(policy_error, sizeof policy_error, "cannot read %s", GUARD_BPF);
        free(prog);
        return;
    }
    guard_filter.len = (unsigned short)(st.st_size / sizeof(struct sock_filter));
    guard_filter.filter = prog;
    fd = open("/proc/sys/kernel/cap_last_cap", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        char buf[16] = {0};
        if (read(fd, buf, sizeof buf - 1) > 0) cap_last = atoi(buf);
        close(fd);
    }
    policy_error[0] = 0;
}

/* ------------------------------------------------------------------ the guard's refusals
 *
 * Evidence of cheating (docs/cheating.md): every guarded command's filter is installed with
 * SECCOMP_FILTER_FLAG_LOG, so the guest kernel reports each call it refuses as an audit
 * record (type 1326: pid, comm, exe, syscall, the action) on the audit netlink socket's
 * read-only log group (no auditd, audit need not be enabled). The agent reads them and keeps,
 * for the host, the exact number per system call and the text of the newest GUARD_LOG_MAX
 * records, numbered from 1. AUDIT "after" answers OK with three args: "next total lost"
 * (the number the next record gets, every record counted, receive-buffer overflows), the
 * counts "nr=count ..." (the last slot, GUARD_NR_OTHER, any number above it), and the kept
 * records numbered above "after", one a line: "seq text". A flood costs the guest a fixed
 * amount of memory; the host reads the counts exactly and the details it has not seen. */
#define GUARD_LOG_MAX 64
#define GUARD_LOG_TEXT 480
#define GUARD_NR_OTHER 1024
#define AUDIT_SECCOMP_RECORD 1326
static struct {
    uint64_t seq;
    char text[GUARD_LOG_TEXT];
} guard_log[GUARD_LOG_MAX];
static uint64_t guard_log_next = 1;
static uint64_t guard_counts[GUARD_NR_OTHER + 1];
static uint64_t guard_total, guard_lost;
static int audit_fd = -1;

static void open_guard_log(void) {
    if (!guard_filter.len) return; /* no guard, no filter: nothing to report */
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC | SOCK_NONBLOCK, NETLINK_AUDIT);
    if (fd < 0) {
        fprintf(stderr, "dsec-agent: no audit socket, the guard's refusals are not reported: %s\n", strerror(errno));
        return;
    }
    int size = 1 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof size);
    struct sockaddr_nl sa = {.nl_family = AF_NETLINK, .nl_groups = 1 /* AUDIT_NLGRP_READLOG */};
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        fprintf(stderr, "dsec-agent: cannot join the audit log group: %s\n", strerror(errno));
        close(fd);
        return;
    }
    audit_fd = fd;
}

static void guard_log_record(const char *text, size_t n) {
    const char *sc = memmem(text, n, " syscall=", 9);
    long nr = sc ? strtol(sc + 9, NULL, 10) : -1;
    if (!memmem(text, n, " arch=c000003e", 14)) nr = -1; /* another architecture: "other" */
    guard_counts[nr >= 0 && nr < GUARD_NR_OTHER ? nr : GUARD_NR_OTHER]++;
    guard_total++;
    uint64_t seq = guard_log_next++;
    size_t slot = (size_t)(seq % GUARD_LOG_MAX), k = n < GUARD_LOG_TEXT - 1 ? n : GUARD_LOG_TEXT - 1;
    guard_log[slot].seq = seq;
    memcpy(guard_log[slot].text, text, k);
    guard_log[slot].text[k] = 0;
    for (size_t i = 0; i < k; i++) /* one record a line */
        if (guard_log[slot].text[i] == '\n') guard_log[slot].text[i] = ' ';
}

/* Read every record waiting on the audit socket. */
static void read_guard_log(void) {
    static char buf[16384];
    if (audit_fd < 0) return;
    for (int round = 0; round < 1024; round++) {
        ssize_t got = recv(audit_fd, buf, sizeof buf - 1, 0);
        if (got < 0) {
            if (errno == ENOBUFS) {
                guard_lost++;
                continue;
            }
            return; /* EAGAIN: drained */
        }
        size_t off = 0;
        while (off + NLMSG_HDRLEN <= (size_t)got) {
            struct nlmsghdr h;
            memcpy(&h, buf + off, sizeof h);
            if (h.nlmsg_len < NLMSG_HDRLEN || off + h.nlmsg_len > (size_t)got) break;
            if (h.nlmsg_type == AUDIT_SECCOMP_RECORD) {
                size_t n = h.nlmsg_len - NLMSG_HDRLEN;
                const char *text = buf + off + NLMSG_HDRLEN;
                while (n > 0 && text[n - 1] == 0) n--;
                guard_log_record(text, n);
            }
            off += NLMSG_ALIGN(h.nlmsg_len);
        }
    }
}

/* A new sandbox (SETUP's "new sandbox" flag): what a template or the parent of a fork
 * was refused is not its evidence. Record numbers go on. */
static void reset_guard_log(void) {
    read_guard_log();
    memset(guard_counts, 0, sizeof guard_counts);
    guard_total = guard_lost = 0;
    for (int i = 0; i < GUARD_LOG_MAX; i++) guard_log[i].seq = 0;
}

static void do_audit(uint32_t id, int nargs, struct arg *a) {
    uint64_t after = nargs > 0 ? arg_num(&a[0], 0) : 0;
    read_guard_log();
    char head[96];
    snprintf(head, sizeof head, "%llu %llu %llu", (unsigned long long)guard_log_next,
             (unsigned long long)guard_total, (unsigned long long)guard_lost);
    size_t cap = 64 + GUARD_LOG_MAX * (GUARD_LOG_TEXT + 24);
    char *counts = malloc(cap), *records = malloc(cap);
    if (!counts || !records) {
        free(counts);
        free(records);
        send_err(id, ENOMEM, "audit");
        return;
    }
    size_t cn = 0, rn = 0;
    counts[0] = records[0] = 0;
    for (int nr = 0; nr <= GUARD_NR_OTHER && cn + 48 < cap; nr++)
        if (guard_counts[nr])
            cn += (size_t)snprintf(counts + cn, cap - cn, "%s%d=%llu", cn ? " " : "", nr,
                                   (unsigned long long)guard_counts[nr]);
    uint64_t first = guard_log_next > GUARD_LOG_MAX ? guard_log_next - GUARD_LOG_MAX : 1;
    if (first <= after) first = after + 1;
    for (uint64_t seq = first; seq < guard_log_next && rn + GUARD_LOG_TEXT + 24 < cap; seq++) {
        size_t slot = (size_t)(seq % GUARD_LOG_MAX);
        if (guard_log[slot].seq != seq) continue;
        rn += (size_t)snprintf(records + rn, cap - rn, "%llu %s\n", (unsigned long long)seq, guard_log[slot].text);
    }
    struct arg out[3] = {str_arg(head), {counts, (uint32_t)cn}, {records, (uint32_t)rn}};
    send_frame(id, OP_OK, 3, out);
    free(counts);
    free(records);
}

/* What nsinit tells the agent once the namespaces are built (or why they are not). */
struct ns_report {
    int err;     /* errno of the step that failed, 0 */
    int step;    /* NS_* of that step */
    int guarded; /* B was built */
    int full_fd; /* nsinit's fd of A (-1: A failed) */
    char what[160];
};

enum { NS_OK, NS_PRIVATE, NS_PROC, NS_ROOT, NS_FULL, NS_UNSHARE, NS_DEV, NS_MASK, NS_READONLY, NS_SYS, NS_CGROUP };
static const char *const ns_steps[] = {
    "ok", "private mounts", "procfs of the PID namespace", "moving the sandbox root onto /",
    "opening the full mount namespace", "unshare of the guarded mount namespace", "the commands' /dev",
    "masking", "read-only bind", "read-only /sys", "read-only cgroup2",
};

static int in_list(char *const *list, int n, const char *p) {
    for (int i = 0; i < n; i++)
        if (strcmp(list[i], p) == 0) return 1;
    return 0;
}

/* Hide ``p`` (absent: nothing to hide): /dev/null bound over a file, an empty read-only tmpfs
 * over a directory. */
static int mask_path(const char *p) {
    struct stat st;
    if (stat(p, &st) < 0) return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
    if (S_ISDIR(st.st_mode)) return mount("tmpfs", p, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555");
    return mount("/dev/null", p, NULL, MS_BIND, NULL);
}

static int readonly_path(const char *p) {
    struct stat st;
    if (stat(p, &st) < 0) return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
    if (mount(p, p, NULL, MS_BIND | MS_REC, NULL) < 0) return -1;
    return mount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
}

/* Replace /dev (the guest's devtmpfs: every device, the layer and writable disks among them)
 * by a tmpfs holding the policy's devices (and tty1, the vm tier's console), /dev/pts and
 * /dev/shm (the same instances the agent's view has) and the usual symlinks. */
static int make_guarded_dev(void) {
    struct {
        const char *name;
        dev_t rdev;
        mode_t mode;
    } nodes[MAX_GUARD_DEVS + 1];
    int n = 0;
    char p[64];
    for (int i = 0; i <= n_guard_devs; i++) {
        const char *name = i < n_guard_devs ? guard_devs[i] : tty_wanted ? "tty1" : NULL;
        struct stat st;
        if (!name) continue;
        snprintf(p, sizeof p, "/dev/%s", name);
        if (stat(p, &st) < 0 || !S_ISCHR(st.st_mode)) continue;
        nodes[n].name = name;
        nodes[n].rdev = st.st_rdev;
        nodes[n++].mode = st.st_mode & 0777;
    }
    int pts = (int)syscall(SYS_open_tree, AT_FDCWD, "/dev/pts", OPEN_TREE_CLONE | O_CLOEXEC);
    int shm = (int)syscall(SYS_open_tree, AT_FDCWD, "/dev/shm", OPEN_TREE_CLONE | O_CLOEXEC);
    if (pts < 0 || shm < 0) return -1;
    if (umount2("/dev", MNT_DETACH) < 0) return -1;
    if (mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC | MS_STRICTATIME, "mode=755,size=65536k") < 0) return -1;
    for (int i = 0; i < n; i++) {
        snprintf(p, sizeof p, "/dev/%s", nodes[i].name);
        if (mknod(p, S_IFCHR | nodes[i].mode, nodes[i].rdev) < 0) return -1;
    }
    if (mkdir("/dev/pts", 0755) < 0 || mkdir("/dev/shm", 01777) < 0) return -1;
    if (syscall(SYS_move_mount, pts, "", AT_FDCWD, "/dev/pts", MOVE_MOUNT_F_EMPTY_PATH) < 0) return -1;
    if (syscall(SYS_move_mount, shm, "", AT_FDCWD, "/dev/shm", MOVE_MOUNT_F_EMPTY_PATH) < 0) return -1;
    close(pts);
    close(shm);
    static const char *const links[][2] = {
        {"pts/ptmx", "/dev/ptmx"},          {"/proc/self/fd", "/dev/fd"},
        {"/proc/self/fd/0", "/dev/stdin"}, {"/proc/self/fd/1", "/dev/stdout"},
        {"/proc/self/fd/2", "/dev/stderr"},
    };
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++)
        if (symlink(links[i][0], links[i][1]) < 0) return -1;
    return 0;
}

/* The init of the commands' PID namespace (forked by make_namespaces, in a new mount
 * namespace). Builds A and B, reports on ``report_fd``, then only reaps orphans. Signals: all
 * blocked, and as the init of its namespace the kernel drops those its namespace sends it
 * (SIGKILL too); it is outside the commands' cgroup and has oom_score_adj -1000. */
static void nsinit_main(int report_fd) {
    struct ns_report rep;
    memset(&rep, 0, sizeof rep);
    rep.full_fd = -1;
    if (report_fd > 3) syscall(SYS_close_range, 3, report_fd - 1, 0);
    syscall(SYS_close_range, report_fd + 1, ~0u, 0);
    prctl(PR_SET_NAME, "dsec-nsinit", 0, 0, 0);
    if (argv_area && argv_area_len > sizeof "dsec-nsinit") { /* its /proc/1/cmdline */
        memset(argv_area, 0, argv_area_len);
        memcpy(argv_area, "dsec-nsinit", sizeof "dsec-nsinit");
    }
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    umask(0);
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (write(fd, "-1000", 5) < 0) { /* best effort */
        }
        close(fd);
    }
    char p[PATH_MAX];
#define NS_STEP(s, expr)                                                                                       \
    do {                                                                                                       \
        if ((expr) < 0) {                                                                                      \
            rep.err = errno ? errno : EINVAL;                                                                  \
            rep.step = (s);                                                                                    \
            goto report;                                                                                       \
        }                                                                                                      \
    } while (0)
    NS_STEP(NS_PRIVATE, mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL));
    snprintf(p, sizeof p, "%s/proc", sandbox_root);
    umount2(p, MNT_DETACH); /* the guest's procfs: it would show the agent */
    NS_STEP(NS_PROC, mount("proc", p, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
    NS_STEP(NS_ROOT, chdir(sandbox_root));
    NS_STEP(NS_ROOT, mount(".", "/", NULL, MS_MOVE, NULL));
    NS_STEP(NS_ROOT, chroot("."));
    NS_STEP(NS_ROOT, chdir("/"));
    NS_STEP(NS_FULL, rep.full_fd = open("/proc/self/ns/mnt", O_RDONLY)); /* keeps A alive */
    if (policy_error[0]) goto report; /* no policy: only A */
    NS_STEP(NS_UNSHARE, unshare(CLONE_NEWNS));
    NS_STEP(NS_DEV, make_guarded_dev());
    for (int i = 0; i < n_guard_masked; i++) {
        snprintf(rep.what, sizeof rep.what, "%s", guard_masked[i]);
        NS_STEP(NS_MASK, mask_path(guard_masked[i]));
    }
    for (int i = 0; i < n_guard_readonly; i++) {
        if (in_list(guard_masked, n_guard_masked, guard_readonly[i])) continue; /* /dev/null already */
        snprintf(rep.what, sizeof rep.what, "%s", guard_readonly[i]);
        NS_STEP(NS_READONLY, readonly_path(guard_readonly[i]));
    }
    rep.what[0] = 0;
    NS_STEP(NS_SYS, mount(NULL, "/sys", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
    struct stat st;
    if (cmd_cg_fd >= 0 && stat("/sys/fs/cgroup", &st) == 0 && S_ISDIR(st.st_mode))
        NS_STEP(NS_CGROUP, mount("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                 cg_mount_opts[0] ? cg_mount_opts : NULL));
    rep.guarded = 1;
#undef NS_STEP
report:
    if (write(report_fd, &rep, sizeof rep) < 0) _exit(1);
    close(report_fd);
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
    }
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG | __WALL) > 0) {
        }
        sigwaitinfo(&chld, NULL);
    }
}

/* Enter the commands' mount namespace of this sandbox's mode (the agent's file API and its
 * children then see what commands see). */
static int enter_commands_ns(void) {
    if (!ns_ok) return 0;
    int fd = full_guest || guard_mnt_fd < 0 ? full_mnt_fd : guard_mnt_fd;
    if (setns(fd, CLONE_NEWNS) < 0) {
        snprintf(guard_error, sizeof guard_error, "entering the commands' mount namespace: %s", strerror(errno));
        return -1;
    }
    return 0;
}

static int open_proc_of(pid_t pid, const char *what) {
    char p[64];
    snprintf(p, sizeof p, "/proc/%d/%s", (int)pid, what);
    return open(p, O_RDONLY | O_CLOEXEC);
}

/* (Re)build the commands' namespaces. On success the agent's children are born in the new PID
 * namespace and the agent is in the mount namespace of its mode; returns 0. On failure the agent
 * is in the guest's own namespaces at the initramfs root, guard_error says why, returns -1. */
static int make_namespaces(void) {
    ns_ok = 0;
    if (root_mnt_fd < 0 || root_pid_fd < 0 || setns(root_mnt_fd, CLONE_NEWNS) < 0 || setns(root_pid_fd, CLONE_NEWPID) < 0) {
        snprintf(guard_error, sizeof guard_error, "the guest's own namespaces: %s", strerror(errno));
        return -1;
    }
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) {
        snprintf(guard_error, sizeof guard_error, "pipe: %s", strerror(errno));
        return -1;
    }
    /* a fork (no new stack) into a new PID and mount namespace: only system calls follow */
    pid_t pid = (pid_t)syscall(SYS_clone, (unsigned long)(CLONE_NEWPID | CLONE_NEWNS | SIGCHLD), NULL, NULL, NULL, 0);
    if (pid == 0) {
        close(p[0]);
        nsinit_main(p[1]);
        _exit(0);
    }
    close(p[1]);
    struct ns_report rep;
    ssize_t n = -1;
    if (pid > 0) {
        do n = read(p[0], &rep, sizeof rep);
        while (n < 0 && errno == EINTR);
    }
    close(p[0]);
    if (pid < 0 || n != (ssize_t)sizeof rep || rep.full_fd < 0) {
        if (pid < 0)
            snprintf(guard_error, sizeof guard_error, "the commands' PID namespace: %s", strerror(errno));
        else if (n != (ssize_t)sizeof rep)
            snprintf(guard_error, sizeof guard_error, "the commands' namespace init died while building them");
        else
            snprintf(guard_error, sizeof guard_error, "the commands' namespaces: %s: %s", ns_steps[rep.step], strerror(rep.err));
        if (pid > 0) kill(pid, SIGKILL); /* reaped by reap() */
        return -1;
    }
    char fdname[32];
    snprintf(fdname, sizeof fdname, "fd/%d", rep.full_fd);
    int pid_fd = open_proc_of(pid, "ns/pid"), full_fd = open_proc_of(pid, fdname);
    int guarded_fd = rep.guarded ? open_proc_of(pid, "ns/mnt") : -1;
    if (pid_fd < 0 || full_fd < 0 || (rep.guarded && guarded_fd < 0) || setns(pid_fd, CLONE_NEWPID) < 0) {
        snprintf(guard_error, sizeof guard_error, "opening the commands' namespaces: %s", strerror(errno));
        if (pid_fd >= 0) close(pid_fd);
        if (full_fd >= 0) close(full_fd);
        if (guarded_fd >= 0) close(guarded_fd);
        setns(root_pid_fd, CLONE_NEWPID);
        kill(pid, SIGKILL);
        return -1;
    }
    if (cmd_pid_fd >= 0) close(cmd_pid_fd);
    if (full_mnt_fd >= 0) close(full_mnt_fd);
    if (guard_mnt_fd >= 0) close(guard_mnt_fd);
    cmd_pid_fd = pid_fd;
    full_mnt_fd = full_fd;
    guard_mnt_fd = guarded_fd;
    nsinit_pid = pid;
    if (rep.guarded)
        guard_error[0] = 0;
    else if (policy_error[0])
        snprintf(guard_error, sizeof guard_error, "%s", policy_error);
    else
        snprintf(guard_error, sizeof guard_error, "the guarded mount namespace: %s%s%s: %s", ns_steps[rep.step],
                 rep.what[0] ? " " : "", rep.what, strerror(rep.err));
    ns_ok = 1;
    if (enter_commands_ns() < 0) {
        ns_ok = 0;
        setns(root_mnt_fd, CLONE_NEWNS);
        setns(root_pid_fd, CLONE_NEWPID);
        return -1;
    }
    return 0;
}

/* Without the commands' namespaces (they could not be built): the agent chroots into the
 * sandbox root as it did before they existed; only full_guest commands can run. */
static void enter_root_without_namespaces(void) {
    if (chdir(sandbox_root) < 0 || chroot(".") < 0 || chdir("/") < 0)
        fprintf(stderr, "dsec-agent: chroot %s: %s\n", sandbox_root, strerror(errno));
}

/* The namespaces again if their init died (a full guest can kill it: sysrq, a module): the
 * kernel then killed every process in them, and no process can be born there any more. */
static void ensure_namespaces(void) {
    if (!ns_ok || nsinit_pid > 0) return;
    fprintf(stderr, "dsec-agent: the commands' namespaces ended; building them again\n");
    if (make_namespaces() < 0) {
        fprintf(stderr, "dsec-agent: %s\n", guard_error);
        enter_root_without_namespaces();
    }
}

/* ------------------------------------------------------------------ setup after boot/restore */

/* Resize the writable layer (the tmpfs at /rw of the initramfs) to ``disk_mb`` MiB. A remount
 * must come from the mount namespace holding the mount: the guest's own. Returns 0 or -errno. */
static int remount_upper(long disk_mb) {
    char opts[64];
    snprintf(opts, sizeof opts, "size=%ldm", disk_mb);
    if (!ns_ok) {
        char target[64];
        if (upper_fd < 0) return -ENOENT;
        snprintf(target, sizeof target, "/proc/self/fd/%d", upper_fd);
        return mount(NULL, target, NULL, MS_REMOUNT, opts) < 0 ? -errno : 0;
    }
    if (setns(root_mnt_fd, CLONE_NEWNS) < 0) return -errno;
    int r = mount(NULL, "/rw", NULL, MS_REMOUNT, opts) < 0 ? -errno : 0;
    if (enter_commands_ns() < 0) { /* never left in the guest's own view: commands would inherit it */
        ns_ok = 0;
        fprintf(stderr, "dsec-agent: %s\n", guard_error);
        enter_root_without_namespaces();
        if (r == 0) r = -EIO;
    }
    return r;
}

static void restart_tty(void);

static void do_setup(uint32_t id, int nargs, struct arg *a) {
    /* args: unix time ns, random seed, hostname, writable layer MiB (0 = keep)
     *       [, pids limit of the commands (0 = keep) [, their memory limit in MiB (0 = keep)
     *       [, full guest: "1" (commands without the guard), "0" (with it), "" (keep)
     *       [, new sandbox: "1" (the guard's refusals so far are forgotten)]]]] */
    if (nargs < 4) {
        send_err(id, EINVAL, "setup needs time, seed, hostname, disk_mb");
        return;
    }
    if (nargs > 6 && a[6].n > 0) {
        int want = a[6].p[0] == '1';
        if (!want && full_guest) {
            send_err(id, EPERM, "a full guest cannot have the guard back (its commands had the whole guest)");
            return;
        }
        if (want && !full_guest) {
            full_guest = 1;
            if (enter_commands_ns() < 0) {
                send_err(id, errno, guard_error);
                return;
            }
            restart_tty();
        }
    }
    if (nargs > 7 && a[7].n > 0 && a[7].p[0] == '1') reset_guard_log();
    char *t = arg_str(&a[0]);
    long long ns = t ? strtoll(t, NULL, 10) : 0;
    free(t);
    if (ns > 0) {
        struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
        if (clock_settime(CLOCK_REALTIME, &ts) < 0) {
            send_err(id, errno, "clock_settime");
            return;
        }
    }
    if (a[1].n > 0) {
        int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            size_t n = a[1].n > 512 ? 512 : a[1].n;
            struct rand_pool_info *info = malloc(sizeof *info + n);
            if (info) {
                info->entropy_count = (int)(n * 8);
                info->buf_size = (int)n;
                memcpy(info->buf, a[1].p, n);
                if (ioctl(fd, RNDADDENTROPY, info) < 0) write_all(fd, a[1].p, n);
                free(info);
            }
            ioctl(fd, RNDRESEEDCRNG);
            close(fd);
        }
    }
    if (a[2].n > 0) sethostname(a[2].p, a[2].n);
    char *d = arg_str(&a[3]);
    long disk_mb = d ? atol(d) : 0;
    free(d);
    if (disk_mb > 0) {
        int r = remount_upper(disk_mb);
        if (r < 0) {
            send_err(id, -r, "remount writable layer");
            return;
        }
    }
    if (nargs > 4 && cmd_cg_fd >= 0) {
        unsigned long long pids = arg_num(&a[4], 0);
        if (pids > 0) {
            char v[32];
            snprintf(v, sizeof v, "%llu", pids);
            int r = cg_write(cmd_cg_fd, "pids.max", v);
            if (r < 0) {
                send_err(id, -r, "pids.max");
                return;
            }
            long long reserve = (long long)pids / 4 > 8 ? 8 : (long long)pids / 4;
            leaf_pids_max = (long long)pids - (reserve < 1 ? 1 : reserve);
            for (int i = 0; i < n_free_leaves; i++) set_leaf_pids(free_leaves[i].name);
            set_leaf_pids("tty");
        }
    }
    if (nargs > 5 && cmd_cg_fd >= 0) {
        unsigned long long mb = arg_num(&a[5], 0);
        if (mb > 0) {
            char v[32];
            snprintf(v, sizeof v, "%llu", mb << 20);
            int r = cg_write(cmd_cg_fd, "memory.max", v);
            if (r < 0) {
                send_err(id, -r, "memory.max");
                return;
            }
        }
    }
    send_ok(id);
}

/* ------------------------------------------------------------------ exec */

/* Resolve "name", "uid", "name:gid" or "uid:gid" against /etc/passwd. Returns 0 or -errno. */
static int resolve_user(const char *spec, uid_t *uid, gid_t *gid, char *home, size_t home_len) {
    *uid = 0;
    *gid = 0;
    snprintf(home, home_len, "/root");
    if (!spec || !*spec) return 0;
    char name[256];
    snprintf(name, sizeof name, "%s", spec);
    char *colon = strchr(name, ':');
    long explicit_gid = -1;
    if (colon) {
        *colon = 0;
        explicit_gid = atol(colon + 1);
    }
    int numeric = name[0] != 0 && strspn(name, "0123456789") == strlen(name);
    int found = 0;
    FILE *f = fopen("/etc/passwd", "re");
    if (f) {
        char line[1024];
        while (fgets(line, sizeof line, f)) {
            char *fields[7] = {0};
            char *p = line;
            int i = 0;
            for (; i < 7 && p; i++) {
                fields[i] = p;
                p = strchr(p, ':');
                if (p) *p++ = 0;
            }
            if (i < 6 || !fields[2] || !fields[3]) continue;
            if (numeric ? atol(fields[2]) == atol(name) : strcmp(fields[0], name) == 0) {
                *uid = (uid_t)atol(fields[2]);
                *gid = (gid_t)atol(fields[3]);
                if (fields[5] && *fields[5]) snprintf(home, home_len, "%s", fields[5]);
                found = 1;
                break;
            }
        }
        fclose(f);
    }
    if (!found) {
        if (!numeric) return -ESRCH;
        *uid = (uid_t)atol(name);
        *gid = (gid_t)atol(name);
        snprintf(home, home_len, "/");
    }
    if (explicit_gid >= 0) *gid = (gid_t)explicit_gid;
    return 0;
}

/* What a command's child process needs between its birth and execve. */
struct child_ctx {
    int fd_in, fd_out, fd_err;
    const char *cwd, *user;
    uid_t uid;
    gid_t gid;
    char **argv, **envp;
    int exe_fd;         /* execute this file (busybox for tool commands), else search PATH */
    const char *cgroup; /* leaf to join by writing cgroup.procs (when not born into it) */
    int placed;         /* born in the leaf (clone3 CLONE_INTO_CGROUP) */
    int guard;          /* apply the guard's rlimits, capabilities, no_new_privs and filter */
    int ctty;           /* make fd 0 (a terminal) the controlling terminal */
};

/* execvp() with the PATH of ``envp`` (not of this process) and no writes to shared memory:
 * safe in a child that shares the agent's memory (CLONE_VM). Only candidates that exist and
 * are executable are execve'd. Returns the errno to report. */
static int exec_search(const char *file, char **argv, char **envp) {
    if (!*file) return ENOENT;
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        return errno;
    }
    const char *path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    for (char **e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) path = *e + 5;
    int err = ENOENT, seen_eacces = 0;
    size_t flen = strlen(file);
    char buf[PATH_MAX];
    for (const char *p = path;; p++) {
        const char *q = strchrnul(p, ':');
        size_t dlen = (size_t)(q - p);
        if (dlen + flen + 2 <= sizeof buf) {
            memcpy(buf, p, dlen);
            size_t off = dlen;
            if (dlen > 0) buf[off++] = '/';
            memcpy(buf + off, file, flen + 1);
            /* a path walk first: a failing execve builds a whole new mm and copies argv and
             * envp into it before it looks the file up (~0.5 ms per PATH entry under TCG) */
            if (faccessat(AT_FDCWD, buf, X_OK, AT_EACCESS) == 0) execve(buf, argv, envp);
            if (errno == EACCES)
                seen_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR)
                err = errno;
            if (errno == ENOEXEC) { /* a script without #!: run it with the shell, as execvp does */
                int argc = 0;
                while (argv[argc]) argc++;
                if (argc > 4096) return E2BIG; /* sh_argv lives on the child's stack */
                char *sh_argv[argc + 2];
                sh_argv[0] = (char *)"/bin/sh";
                sh_argv[1] = buf;
                for (int i = 1; i <= argc; i++) sh_argv[i + 1] = argv[i];
                execve("/bin/sh", sh_argv, envp);
                return errno;
            }
        }
        if (!*q) break;
        p = q;
    }
    return seen_eacces && err == ENOENT ? EACCES : err;
}

/* A command that cannot start: say why on its stderr; 126 is its exit code. */
static int child_fail(const char *what) {
    dprintf(2, "dsec: %s: %s\n", what, strerror(errno));
    return 126;
}

/* The child of a command, from birth to execve. Runs on its own stack in the agent's memory
 * when spawned with CLONE_VM (the agent is stopped until the execve): only system calls and
 * local variables here, nothing that writes the agent's globals or heap. Returns the exit code
 * when the command cannot start. A guarded command (not full_guest) also gets the guard's
 * rlimits, capability bounding set and capabilities, no_new_privs, a Landlock domain of its
 * own and seccomp filter; it is already in the commands' namespaces (born in their PID namespace, in the agent's mount
 * namespace of the guarded view). */
static int command_child(void *arg) {
    struct child_ctx *cx = arg;
    sigset_t all;
    sigemptyset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    setsid();
    if (cx->cgroup && !cx->placed) {
        char procs[64];
        snprintf(procs, sizeof procs, "%s/cgroup.procs", cx->cgroup);
        cg_write(cmd_cg_fd, procs, "0");
    }
    dup2(cx->fd_in, 0);
    dup2(cx->fd_out, 1);
    dup2(cx->fd_err, 2);
    setpriority(PRIO_PROCESS, 0, 0); /* the agent runs at -20 */
    if (cx->ctty && ioctl(0, TIOCSCTTY, 1) < 0) return child_fail("controlling terminal");
    if (chdir(cx->cwd) < 0) {
        dprintf(2, "dsec: cwd %s: %s\n", cx->cwd, strerror(errno));
        return 126;
    }
    if (cx->guard) { /* the order of dsec_execd (the container tier) */
        for (int i = 0; i < n_guard_rlimits; i++)
            if (setrlimit(guard_rlimits[i].res, &guard_rlimits[i].lim) < 0) return child_fail("guard: rlimit");
        for (int c = 0; c <= cap_last; c++)
            if (!(guard_caps & (1ull << c)) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL)
                return child_fail("guard: capability bounding set");
    }
    if (cx->uid != 0 || cx->gid != 0) {
        if (setgroups(0, NULL) < 0 || setgid(cx->gid) < 0 || setuid(cx->uid) < 0) {
            dprintf(2, "dsec: set user %s: %s\n", cx->user, strerror(errno));
            return 126;
        }
    }
    if (cx->guard) {
        struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
        struct __user_cap_data_struct d[2];
        uint64_t caps = cx->uid == 0 ? guard_caps : 0;
        for (int i = 0; i < 2; i++) d[i].effective = d[i].permitted = d[i].inheritable = (uint32_t)(caps >> (32 * i));
        if (syscall(SYS_capset, &h, d) < 0) return child_fail("guard: capset");
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return child_fail("guard: no_new_privs");
        /* REFER beneath this command's own root (the agent's "/" when it made the ruleset
         * was the initramfs: renames and links in the sandbox root were refused, EXDEV) */
        if (command_domain_fd >= 0 && command_domain_refer && add_refer_beneath_root(command_domain_fd) < 0)
            return child_fail("guard: landlock rule");
        if (command_domain_fd >= 0 && syscall(SYS_landlock_restrict_self, command_domain_fd, 0) < 0)
            return child_fail("guard: landlock");
        /* logged: the guest kernel reports each refusal (the guard's refusals, above) */
        if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, audit_fd >= 0 ? SECCOMP_FILTER_FLAG_LOG : 0, &guard_filter) < 0)
            return child_fail("guard: seccomp");
    }
    int err;
    if (cx->exe_fd >= 0) {
        fexecve(cx->exe_fd, cx->argv, cx->envp);
        err = errno;
    } else {
        err = exec_search(cx->argv[0], cx->argv, cx->envp);
    }
    dprintf(2, "dsec: exec %s: %s\n", cx->argv[0], strerror(err));
    return err == ENOENT ? 127 : 126;
}

#if defined(__x86_64__)
/* clone3() whose child runs fn(arg) on the stack given in ``args`` and exits with its return
 * value (glibc 2.36 has no clone3 wrapper). Returns the child's pid, or -1 with errno. */
static pid_t clone3_run(struct clone_args *args, int (*fn)(void *), void *arg) {
    long ret;
    register void *r12 __asm__("r12") = (void *)fn;
    register void *r13 __asm__("r13") = arg;
    __asm__ volatile("syscall\n\t"
                     "test %%rax, %%rax\n\t"
                     "jnz 1f\n\t"
                     "xor %%ebp, %%ebp\n\t"
                     "mov %%r13, %%rdi\n\t"
                     "call *%%r12\n\t"
                     "mov %%eax, %%edi\n\t"
                     "mov $60, %%eax\n\t" /* SYS_exit */
                     "syscall\n\t"
                     "hlt\n"
                     "1:"
                     : "=a"(ret)
                     : "a"((long)SYS_clone3), "D"(args), "S"(sizeof *args), "r"(r12), "r"(r13)
                     : "rcx", "r11", "memory");
    if (ret < 0) {
        errno = (int)-ret;
        return -1;
    }
    return (pid_t)ret;
}
#endif

/* Start a command's child. Under TCG process creation dominates an exec round trip, so:
 * - CLONE_VM | CLONE_VFORK: no copy of the agent's page tables and no copy-on-write faults
 *   (the agent waits, about 0.1 ms, until the child's execve);
 * - CLONE_INTO_CGROUP: the child is born in its leaf cgroup; moving it afterwards (writing
 *   cgroup.procs) takes cgroup_threadgroup_rwsem for writing and costs ~5 ms under TCG.
 * Falls back to fork() and cgroup.procs where clone3 or a flag is missing. */
static pid_t spawn_command(struct child_ctx *cx, int cgroup_fd) {
#if defined(__x86_64__)
    static char stack[256 * 1024] __attribute__((aligned(16)));
    struct clone_args args;
    memset(&args, 0, sizeof args);
    args.flags = CLONE_VM | CLONE_VFORK;
    args.exit_signal = SIGCHLD;
    args.stack = (uint64_t)(uintptr_t)stack;
    args.stack_size = sizeof stack;
    if (cgroup_fd >= 0) {
        args.flags |= CLONE_INTO_CGROUP;
        args.cgroup = (uint64_t)cgroup_fd;
    }
    cx->placed = cgroup_fd >= 0;
    pid_t pid = clone3_run(&args, command_child, cx);
    if (pid >= 0 || errno == EAGAIN || errno == ENOMEM) return pid;
#endif
    cx->placed = 0;
    pid_t p = fork();
    if (p == 0) _exit(command_child(cx));
    return p;
}

/* Whether the commands' PID namespace is going away: its init was killed (a full guest can)
 * and waits until every other process of it is gone; no process can be born there then. */
static int nsinit_exiting(void) {
    char p[32], buf[512];
    if (nsinit_pid <= 0) return 1;
    snprintf(p, sizeof p, "%d/stat", (int)nsinit_pid);
    int fd = openat(guest_proc_fd, p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 1;
    buf[n] = 0;
    char *q = strrchr(buf, ')');
    char state = 0;
    unsigned long flags = 0;
    if (!q || sscanf(q + 1, " %c %*d %*d %*d %*d %*d %lu", &state, &flags) != 2) return 0;
    return state == 'Z' || state == 'X' || (flags & 0x4); /* PF_EXITING */
}

/* spawn_command, building the commands' namespaces again first if they are going away (the
 * birth fails with ENOMEM there). */
static pid_t spawn_in_namespaces(struct child_ctx *cx, int leaf_fd) {
    pid_t pid = spawn_command(cx, leaf_fd);
    if (pid < 0 && errno == ENOMEM && ns_ok && nsinit_exiting()) {
        nsinit_pid = 0; /* the old init is reaped later as an unknown child */
        ensure_namespaces();
        if (cx->guard && guard_error[0]) {
            errno = EPERM;
            return -1;
        }
        pid = spawn_command(cx, leaf_fd);
    }
    return pid;
}

/* ------------------------------------------------------------------ the console shell (vm tier)
 *
 * With dsec.tty=1 the display's console (tty1) runs an interactive shell, a command like any
 * other: in the commands' namespaces, under the guard unless the sandbox is a full guest, in the
 * leaf cgroup "tty" (the commands' memory and pids limits). It is respawned when it ends (after
 * 1 s, doubling up to 60 s while it keeps ending within 5 s) and restarted when the sandbox
 * becomes a full guest. */

static void spawn_tty(void) {
    if (!tty_wanted || tty_pid > 0) return;
    ensure_namespaces();
    int64_t now = now_ms();
    tty_respawn_ms = now + tty_delay_ms;
    if (!full_guest && guard_error[0]) return;
    int fd = open("/dev/tty1", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) return;
    int leaf_fd = -1;
    if (cmd_cg_fd >= 0) {
        if (mkdirat(cmd_cg_fd, "tty", 0700) == 0) set_leaf_pids("tty");
        leaf_fd = openat(cmd_cg_fd, "tty", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    }
    static char *argv[] = {"/bin/sh", "-i", NULL};
    static char *envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
                           "TERM=linux", NULL};
    struct child_ctx cx = {
        .fd_in = fd, .fd_out = fd, .fd_err = fd, .cwd = "/", .user = "root", .argv = argv, .envp = envp,
        .exe_fd = -1, .cgroup = leaf_fd >= 0 ? "tty" : NULL, .guard = !full_guest, .ctty = 1,
    };
    pid_t pid = spawn_in_namespaces(&cx, leaf_fd);
    if (leaf_fd >= 0) close(leaf_fd);
    close(fd);
    if (pid > 0) {
        tty_pid = pid;
        tty_started_ms = now;
    }
}

/* The console shell ended (reap). */
static void tty_ended(void) {
    int64_t now = now_ms();
    tty_pid = 0;
    tty_delay_ms = now - tty_started_ms < 5000 ? (tty_delay_ms * 2 > 60000 ? 60000 : tty_delay_ms * 2) : 1000;
    tty_respawn_ms = now + tty_delay_ms;
}

/* Kill the console shell (and what it started) and start it again now (the mode changed). */
static void restart_tty(void) {
    if (!tty_wanted) return;
    if (cmd_cg_fd >= 0) cg_write(cmd_cg_fd, "tty/cgroup.kill", "1");
    if (tty_pid > 0) {
        kill(-tty_pid, SIGKILL);
        kill(tty_pid, SIGKILL);
    }
    tty_pid = 0; /* the old one is reaped as an unknown child */
    tty_delay_ms = 1000;
    spawn_tty();
}

static struct exec_state *exec_by_id(uint32_t id) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (execs[i].used && execs[i].id == id) return &execs[i];
    return NULL;
}

static void do_exec(uint32_t id, int nargs, struct arg *a) {
    /* args: "timeout_ms max_out tool nenv", cwd, user, stdin, env x nenv, argv... */
    if (nargs < 5) {
        send_err(id, EINVAL, "exec needs header, cwd, user, stdin, argv");
        return;
    }
    char *hdr = arg_str(&a[0]);
    long long timeout_ms = 0, max_out = 0;
    int tool = 0, nenv = 0;
    if (!hdr || sscanf(hdr, "%lld %lld %d %d", &timeout_ms, &max_out, &tool, &nenv) != 4 || nenv < 0 ||
        4 + nenv >= nargs) {
        free(hdr);
        send_err(id, EINVAL, "bad exec header");
        return;
    }
    free(hdr);
    struct exec_state *e = NULL;
    for (int i = 0; i < MAX_EXECS; i++)
        if (!execs[i].used) {
            e = &execs[i];
            break;
        }
    if (!e) {
        send_err(id, EAGAIN, "too many concurrent commands");
        return;
    }
    char *cwd = arg_str(&a[1]);
    char *user = arg_str(&a[2]);
    int argc = nargs - 4 - nenv;
    char **envp = calloc((size_t)nenv + 2, sizeof(char *)); /* + HOME, + the terminator */
    int n_envp = nenv;
    char **argv = calloc((size_t)argc + 1, sizeof(char *));
    for (int i = 0; i < nenv; i++) envp[i] = arg_str(&a[4 + i]);
    for (int i = 0; i < argc; i++) argv[i] = arg_str(&a[4 + nenv + i]);
    uid_t uid;
    gid_t gid;
    char home[PATH_MAX];
    int ur = resolve_user(user, &uid, &gid, home, sizeof home);
    int p_out[2] = {-1, -1}, p_err[2] = {-1, -1}, p_in[2] = {-1, -1};
    if (ur < 0) {
        send_err(id, -ur, "unknown user");
        goto out;
    }
    /* HOME is the user's home from the guest's /etc/passwd unless the caller set it */
    int has_home = 0;
    for (int i = 0; i < nenv; i++) has_home |= strncmp(envp[i], "HOME=", 5) == 0;
    if (!has_home && asprintf(&envp[n_envp], "HOME=%s", home) > 0) n_envp++;
    ensure_namespaces();
    if (!full_guest && guard_error[0]) { /* never a guarded sandbox's command without its guard */
        char msg[400];
        snprintf(msg, sizeof msg, "the guard of this sandbox's commands is unavailable (%s)", guard_error);
        char code[16];
        snprintf(code, sizeof code, "%d", EPERM);
        struct arg ea[2] = {str_arg(code), str_arg(msg)};
        send_frame(id, OP_ERR, 2, ea);
        goto out;
    }
    if (pipe2(p_out, O_CLOEXEC) < 0 || pipe2(p_err, O_CLOEXEC) < 0 || pipe2(p_in, O_CLOEXEC) < 0) {
        send_err(id, errno, "pipe");
        goto out;
    }
    char leaf[32] = "";
    long long oom_base = 0;
    if (cmd_cg_fd >= 0) {
        sweep_stale_cgroups();
        take_leaf(leaf, sizeof leaf, &oom_base);
    }
    int leaf_fd = leaf[0] ? openat(cmd_cg_fd, leaf, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
    struct child_ctx cx = {
        .fd_in = p_in[0], .fd_out = p_out[1], .fd_err = p_err[1], .cwd = cwd && *cwd ? cwd : "/",
        .user = user, .uid = uid, .gid = gid, .argv = argv, .envp = envp,
        .exe_fd = tool ? busybox_fd : -1, .cgroup = leaf[0] ? leaf : NULL, .guard = !full_guest,
    };
    pid_t pid = spawn_in_namespaces(&cx, leaf_fd);
    if (leaf_fd >= 0) close(leaf_fd);
    if (pid < 0) {
        int err = errno;
        put_leaf(leaf, oom_base);
        send_err(id, err, "fork");
        goto out;
    }
    close(p_out[1]);
    close(p_err[1]);
    close(p_in[0]);
    p_out[1] = p_err[1] = p_in[0] = -1;
    memset(e, 0, sizeof *e);
    e->used = 1;
    e->id = id;
    e->pid = pid;
    snprintf(e->cgroup, sizeof e->cgroup, "%s", leaf);
    e->oom_base = oom_base;
    e->fd_out = p_out[0];
    e->fd_err = p_err[0];
    e->fd_in = p_in[1];
    fcntl(e->fd_in, F_SETFL, O_NONBLOCK);
    fcntl(e->fd_out, F_SETFL, O_NONBLOCK);
    fcntl(e->fd_err, F_SETFL, O_NONBLOCK);
    e->max_out = (uint64_t)max_out;
    e->start_ms = now_ms();
    e->deadline_ms = timeout_ms > 0 ? e->start_ms + timeout_ms : 0;
    if (a[3].n > 0) {
        e->stdin_buf = malloc(a[3].n);
        memcpy(e->stdin_buf, a[3].p, a[3].n);
        e->stdin_len = a[3].n;
    } else {
        close(e->fd_in);
        e->fd_in = -1;
    }
    p_out[0] = p_err[0] = p_in[1] = -1;
out:
    for (int i = 0; i < 2; i++) {
        if (p_out[i] >= 0) close(p_out[i]);
        if (p_err[i] >= 0) close(p_err[i]);
        if (p_in[i] >= 0) close(p_in[i]);
    }
    for (int i = 0; i < n_envp; i++) free(envp[i]);
    for (int i = 0; i < argc; i++) free(argv[i]);
    free(envp);
    free(argv);
    free(cwd);
    free(user);
}

/* Forward what one of a command's pipes holds. Returns 1 if it read data, 0 if the pipe is
 * empty (the agent's ends are non-blocking) or at its end (then closed). */
static int exec_output(struct exec_state *e, int which) {
    int *fd = which == 1 ? &e->fd_out : &e->fd_err;
    char buf[65536];
    ssize_t r = read(*fd, buf, sizeof buf);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) return 0;
    if (r <= 0) {
        close(*fd);
        *fd = -1;
        return 0;
    }
    uint64_t *count = which == 1 ? &e->n_out : &e->n_err;
    int *trunc = which == 1 ? &e->trunc_out : &e->trunc_err;
    uint64_t room = *count < e->max_out ? e->max_out - *count : 0;
    uint64_t keep = (uint64_t)r < room ? (uint64_t)r : room;
    if (keep < (uint64_t)r) *trunc = 1;
    *count += keep;
    if (keep > 0) {
        struct arg out[2] = {{which == 1 ? "1" : "2", 1}, {buf, (uint32_t)keep}};
        send_frame(e->id, OP_OUT, 2, out);
    }
    return 1;
}

/* Once a command has exited, take what is left in its pipes now rather than on later turns of
 * the loop, so its last output and its exit status usually leave in one write. Bounded: a
 * background process that keeps writing is read on later turns (until DRAIN_GRACE_MS). */
static void exec_drain(struct exec_state *e) {
    for (int which = 1; which <= 2; which++)
        for (int i = 0; i < 16 && (which == 1 ? e->fd_out : e->fd_err) >= 0; i++)
            if (!exec_output(e, which)) break;
}

static void exec_finish(struct exec_state *e) {
    if (e->fd_out >= 0) close(e->fd_out);
    if (e->fd_err >= 0) close(e->fd_err);
    if (e->fd_in >= 0) close(e->fd_in);
    int code = -1, sig = 0, oom = 0;
    if (WIFEXITED(e->status)) code = WEXITSTATUS(e->status);
    if (WIFSIGNALED(e->status)) sig = WTERMSIG(e->status);
    if (cmd_cg_fd >= 0 && e->cgroup[0]) {
        char p[64];
        snprintf(p, sizeof p, "%s/memory.events", e->cgroup);
        long long kills = cg_read_key(cmd_cg_fd, p, "oom_kill");
        oom = kills > 0 && kills > e->oom_base;
        if (kills >= 0)
            put_leaf(e->cgroup, kills);
        else
            release_cgroup(e->cgroup);
    }
    char text[128];
    snprintf(text, sizeof text, "%d %d %d %d %d %lld %d", code, sig, e->timed_out, e->trunc_out, e->trunc_err,
             (long long)(now_ms() - e->start_ms), oom);
    struct arg a = str_arg(text);
    send_frame(e->id, OP_EXIT, 1, &a);
    free(e->stdin_buf);
    memset(e, 0, sizeof *e);
}

static void reap(void) {
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) return;
        if (pid == nsinit_pid) {
            nsinit_pid = 0; /* rebuilt before the next command (ensure_namespaces) */
            continue;
        }
        if (pid == tty_pid) {
            tty_ended();
            continue;
        }
        for (int i = 0; i < MAX_EXECS; i++) {
            if (execs[i].used && execs[i].pid == pid && !execs[i].exited) {
                execs[i].exited = 1;
                execs[i].status = status;
                execs[i].exit_ms = now_ms();
                /* the command is done: its process group must not outlive it holding pipes */
            }
        }
    }
}

/* ------------------------------------------------------------------ TCP streams */

static struct tcp_stream *stream_by_id(uint32_t id) {
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i].used && streams[i].id == id) return &streams[i];
    return NULL;
}

static void stream_free(struct tcp_stream *t) {
    if (t->fd >= 0) close(t->fd);
    free(t->wbuf);
    memset(t, 0, sizeof *t);
    t->fd = -1;
}

static void send_ack(uint32_t id, uint64_t n) {
    char num[24];
    snprintf(num, sizeof num, "%llu", (unsigned long long)n);
    struct arg a = str_arg(num);
    send_frame(id, OP_TCP_ACK, 1, &a);
}

static void tcp_open(uint32_t id, int nargs, struct arg *a) {
    if (nargs < 2) {
        send_err(id, EINVAL, "tcp open needs port, window");
        return;
    }
    unsigned long long port = arg_num(&a[0], 0), window = arg_num(&a[1], 0);
    if (port < 1 || port > 65535 || window < 1) {
        send_err(id, EINVAL, "tcp open: bad port or window");
        return;
    }
    struct tcp_stream *t = NULL;
    for (int i = 0; i < MAX_STREAMS; i++)
        if (!streams[i].used) {
            t = &streams[i];
            break;
        }
    if (!t || stream_by_id(id)) {
        send_err(id, EAGAIN, "too many open tcp streams");
        return;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        send_err(id, errno, "socket");
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int r = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    if (r < 0 && errno != EINPROGRESS) {
        int e = errno;
        close(fd);
        send_err(id, e, "connect");
        return;
    }
    memset(t, 0, sizeof *t);
    t->used = 1;
    t->id = id;
    t->fd = fd;
    t->window = window;
    t->connecting = r < 0;
    if (!t->connecting) send_ok(id);
}

/* The socket became writable while connecting: the outcome of connect(). */
static void tcp_connected(struct tcp_stream *t) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(t->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err == EINPROGRESS || err == EALREADY) return;
    t->connecting = 0;
    if (err) {
        send_err(t->id, err, "connect");
        stream_free(t);
        return;
    }
    send_ok(t->id);
}

static void tcp_flush(struct tcp_stream *t) {
    size_t off = 0;
    while (off < t->wlen) {
        ssize_t w = send(t->fd, t->wbuf + off, t->wlen - off, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) break;
            t->wlen = 0; /* the peer is gone: drop what is left; reading reports the end */
            t->shut_wanted = 0;
            if (t->closing_ms) stream_free(t);
            return;
        }
        off += (size_t)w;
    }
    if (off > 0) {
        memmove(t->wbuf, t->wbuf + off, t->wlen - off);
        t->wlen -= off;
        if (!t->closing_ms) send_ack(t->id, off);
    }
    if (t->wlen == 0 && t->shut_wanted) {
        shutdown(t->fd, SHUT_WR);
        t->shut_wanted = 0;
    }
    if (t->wlen == 0 && t->closing_ms) stream_free(t);
}

static void tcp_data(uint32_t id, int nargs, struct arg *a) {
    struct tcp_stream *t = stream_by_id(id);
    if (!t || nargs < 1 || t->connecting || t->closing_ms) return; /* closed meanwhile: drop */
    if (t->wlen + a[0].n > t->wcap) {
        size_t ncap = t->wcap ? t->wcap : 65536;
        while (ncap < t->wlen + a[0].n) ncap *= 2;
        if (ncap > 2 * GUEST_WINDOW + STREAM_CHUNK) { /* the host broke the window: end it */
            send_frame(id, OP_TCP_EOF, 0, NULL);
            stream_free(t);
            return;
        }
        char *nb = realloc(t->wbuf, ncap);
        if (!nb) return;
        t->wbuf = nb;
        t->wcap = ncap;
    }
    memcpy(t->wbuf + t->wlen, a[0].p, a[0].n);
    t->wlen += a[0].n;
    tcp_flush(t);
}

/* Forward what the socket holds, within the host's window. */
static void tcp_read(struct tcp_stream *t) {
    static char buf[STREAM_CHUNK];
    while (!t->closing_ms && !t->eof_sent && t->unacked < t->window) {
        size_t want = sizeof buf;
        if (t->window - t->unacked < want) want = (size_t)(t->window - t->unacked);
        ssize_t r = recv(t->fd, buf, want, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == EAGAIN) return;
        if (r <= 0) {
            send_frame(t->id, OP_TCP_EOF, 0, NULL);
            t->eof_sent = 1;
            return;
        }
        struct arg d = {buf, (uint32_t)r};
        send_frame(t->id, OP_TCP_DATA, 1, &d);
        t->unacked += (uint64_t)r;
    }
}

static void tcp_op(uint32_t id, uint16_t op, int nargs, struct arg *a) {
    struct tcp_stream *t;
    switch (op) {
    case OP_TCP_OPEN:
        tcp_open(id, nargs, a);
        break;
    case OP_TCP_DATA:
        tcp_data(id, nargs, a);
        break;
    case OP_TCP_SHUT:
        if ((t = stream_by_id(id)) != NULL) {
            t->shut_wanted = 1;
            if (!t->connecting) tcp_flush(t);
        }
        break;
    case OP_TCP_ACK:
        if ((t = stream_by_id(id)) != NULL && nargs >= 1) {
            unsigned long long n = arg_num(&a[0], 0);
            t->unacked = n >= t->unacked ? 0 : t->unacked - n;
            if (!t->connecting) tcp_read(t);
        }
        break;
    case OP_TCP_CLOSE:
        if ((t = stream_by_id(id)) != NULL && !t->closing_ms) {
            if (t->wlen > 0 && !t->connecting) {
                t->closing_ms = now_ms() + CLOSE_LINGER_MS; /* write what is left first */
                t->id = 0;                                /* its id may be reused now */
            } else {
                stream_free(t);
            }
        }
        break;
    }
}

/* The guest's loopback is down after boot (nothing else configures it): bring it up, so the
 * sandbox's servers can listen on 127.0.0.1 and the port proxy can reach them. */
static void loopback_up(void) {
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
    if (ioctl(fd, SIOCGIFFLAGS, &ifr) == 0 && !(ifr.ifr_flags & IFF_UP)) {
        ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
        if (ioctl(fd, SIOCSIFFLAGS, &ifr) < 0) fprintf(stderr, "dsec-agent: lo up: %s\n", strerror(errno));
    }
    close(fd);
}

/* ------------------------------------------------------------------ request dispatch */

static void dispatch(uint32_t id, uint16_t op, int nargs, struct arg *a) {
    switch (op) {
    case OP_PING:
        send_ok(id);
        break;
    case OP_SETUP:
        do_setup(id, nargs, a);
        break;
    case OP_EXEC:
        do_exec(id, nargs, a);
        break;
    case OP_AUDIT:
        do_audit(id, nargs, a);
        break;
    case OP_SIGNAL: {
        if (nargs < 2) {
            send_err(id, EINVAL, "signal needs exec id, signo");
            break;
        }
        char *t = arg_str(&a[0]);
        char *s = arg_str(&a[1]);
        struct exec_state *e = t ? exec_by_id((uint32_t)strtoul(t, NULL, 10)) : NULL;
        int signo = s ? atoi(s) : SIGKILL;
        free(t);
        free(s);
        if (e && !e->exited) {
            if (signo == SIGKILL) {
                kill_command(e);
            } else {
                kill(-e->pid, signo);
                kill(e->pid, signo);
            }
        }
        send_ok(id);
        break;
    }
    case OP_TCP_OPEN:
    case OP_TCP_DATA:
    case OP_TCP_SHUT:
    case OP_TCP_ACK:
    case OP_TCP_CLOSE:
        tcp_op(id, op, nargs, a);
        break;
    default:
        do_file_op(id, op, nargs, a);
    }
}

static char *rbuf;
static size_t rlen, rcap;

/* Parse and dispatch every complete frame in rbuf. Returns -1 on a corrupt stream. */
static int process_input(void) {
    size_t off = 0;
    while (rlen - off >= 16) {
        uint32_t magic, payload, id;
        uint16_t op, nargs;
        memcpy(&magic, rbuf + off, 4);
        memcpy(&payload, rbuf + off + 4, 4);
        memcpy(&id, rbuf + off + 8, 4);
        memcpy(&op, rbuf + off + 12, 2);
        memcpy(&nargs, rbuf + off + 14, 2);
        if (magic != MAGIC || payload > MAX_FRAME) {
            /* resynchronise: skip one byte and look for the next magic */
            off++;
            continue;
        }
        if (rlen - off - 16 < payload) break;
        struct arg *args = calloc(nargs ? nargs : 1, sizeof(struct arg));
        size_t p = off + 16, end = off + 16 + payload;
        int ok = args != NULL;
        for (int i = 0; ok && i < nargs; i++) {
            uint32_t n;
            if (end - p < 4) {
                ok = 0;
                break;
            }
            memcpy(&n, rbuf + p, 4);
            p += 4;
            if (end - p < n) {
                ok = 0;
                break;
            }
            args[i].p = rbuf + p;
            args[i].n = n;
            p += n;
        }
        if (ok) {
            dispatch(id, op, nargs, args);
        } else {
            send_err(id, EINVAL, "malformed frame");
        }
        free(args);
        off = end;
    }
    memmove(rbuf, rbuf + off, rlen - off);
    rlen -= off;
    return 0;
}

static int read_port(void) {
    if (rcap - rlen < 65536) {
        size_t ncap = rcap ? rcap * 2 : 1 << 20;
        if (ncap > MAX_FRAME + (1 << 20)) ncap = MAX_FRAME + (1 << 20);
        if (ncap <= rlen) {
            rlen = 0; /* unreachable for well-formed input: drop the buffer */
            return 0;
        }
        char *nb = realloc(rbuf, ncap);
        if (!nb) return 0;
        rbuf = nb;
        rcap = ncap;
    }
    ssize_t r = read(port_fd, rbuf + rlen, rcap - rlen);
    if (r < 0) return errno == EINTR || errno == EAGAIN ? 1 : 0;
    if (r == 0) return 0; /* host not connected */
    rlen += (size_t)r;
    process_input();
    return 1;
}

/* ------------------------------------------------------------------ startup */

static int open_agent_port(void) {
    for (int attempt = 0; attempt < 500; attempt++) {
        DIR *d = opendir("/sys/class/virtio-ports");
        if (d) {
            struct dirent *de;
            while ((de = readdir(d)) != NULL) {
                if (de->d_name[0] == '.') continue;
                char p[PATH_MAX], name[64] = {0};
                snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/name", de->d_name);
                int fd = open(p, O_RDONLY | O_CLOEXEC);
                if (fd < 0) continue;
                ssize_t n = read(fd, name, sizeof name - 1);
                close(fd);
                if (n > 0 && name[n - 1] == '\n') name[n - 1] = 0;
                if (strcmp(name, "agent") != 0) continue;
                snprintf(p, sizeof p, "/dev/%s", de->d_name);
                int pfd = open(p, O_RDWR | O_CLOEXEC);
                if (pfd >= 0) {
                    closedir(d);
                    return pfd;
                }
            }
            closedir(d);
        }
        usleep(10000);
    }
    return -1;
}

static void hide_ports(void) {
    DIR *d = opendir("/dev");
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strncmp(de->d_name, "vport", 5) == 0) {
            char p[PATH_MAX];
            snprintf(p, sizeof p, "/dev/%s", de->d_name);
            unlink(p);
        }
    }
    closedir(d);
    rmdir("/dev/virtio-ports");
}

static int launch(int argc, char **argv) {
    int i = 2;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        int fd = open(argv[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || dprintf(fd, "%d\n", getpid()) < 0) {
            fprintf(stderr, "dsec launch: %s: %s\n", argv[i], strerror(errno));
            return 125;
        }
        close(fd);
    }
    if (i + 1 >= argc) {
        fprintf(stderr, "usage: agent --launch <cgroup.procs>... -- program args\n");
        return 125;
    }
    /* KSM (EINVAL on kernels without it); DSEC_KSM=0 leaves the process unmergeable */
    const char *ksm = getenv("DSEC_KSM");
    if (ksm == NULL || strcmp(ksm, "0") != 0) prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0);
    /* DSEC_THP=0: no transparent huge pages for the process (inherited across exec): its
     * anonymous memory is charged by the 4 KiB page it touches, not by the 2 MiB */
    const char *thp = getenv("DSEC_THP");
    if (thp != NULL && strcmp(thp, "0") == 0) prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
    prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0);
    execv(argv[i + 1], &argv[i + 1]);
    fprintf(stderr, "dsec launch: exec %s: %s\n", argv[i + 1], strerror(errno));
    return 127;
}

/* Whether the kernel command line has the word ``word``. */
static int cmdline_has(const char *word) {
    char buf[4096];
    int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    size_t len = strlen(word);
    for (char *p = buf; (p = strstr(p, word)) != NULL; p += len)
        if ((p == buf || p[-1] == ' ') && (p[len] == 0 || p[len] == ' ' || p[len] == '\n')) return 1;
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--launch") == 0) return launch(argc, argv);
    if (argc > 1) sandbox_root = strdup(argv[1]); /* nsinit overwrites the argv strings */
    argv_area = argv[0];
    argv_area_len = (size_t)(argv[argc - 1] + strlen(argv[argc - 1]) + 1 - argv[0]);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); /* inherited by the commands' namespace init */
    /* PID 1 shares its root and cwd (fs_struct) with the kernel's threads; setns() into a mount
     * namespace needs a private one. The kernel threads keep the initramfs root: the helpers the
     * kernel runs as root (modprobe on a module request, a core_pattern pipe) are never looked
     * up in the sandbox root, where a command could have put its own. */
    if (unshare(CLONE_FS) < 0) fprintf(stderr, "dsec-agent: unshare(CLONE_FS): %s\n", strerror(errno));
    /* the agent first whenever it has work, however busy the commands keep the vCPUs (each
     * command starts at nice 0 again) */
    setpriority(PRIO_PROCESS, 0, -20);

    port_fd = open_agent_port();
    if (port_fd < 0) {
        fprintf(stderr, "dsec-agent: no virtio-serial port named 'agent'\n");
        return 1;
    }
    hide_ports();
    setup_cgroups();
    busybox_fd = open("/bin/busybox", O_RDONLY | O_CLOEXEC);
    upper_fd = open("/rw", O_PATH | O_CLOEXEC);
    tty_wanted = cmdline_has("dsec.tty=1");
    if (cmdline_has("dsec.bpf_jit=0")) { /* under TCG: see _kernel_args in runtime.py */
        int fd = open("/proc/sys/net/core/bpf_jit_enable", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            if (write(fd, "0", 1) < 0) fprintf(stderr, "dsec-agent: bpf_jit_enable: %s\n", strerror(errno));
            close(fd);
        }
    }
    load_guard();
    open_guard_log();
    make_command_domain();
    loopback_up();
    for (int i = 0; i < MAX_STREAMS; i++) streams[i].fd = -1;
    guest_proc_fd = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
    root_mnt_fd = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
    root_pid_fd = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGPIPE);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);

    if (make_namespaces() < 0) {
        fprintf(stderr, "dsec-agent: %s; only full_guest sandboxes can run commands\n", guard_error);
        enter_root_without_namespaces();
    }
    spawn_tty();

    struct pollfd pfds[3 + 3 * MAX_EXECS + MAX_STREAMS];
    struct exec_state *owner[3 + 3 * MAX_EXECS + MAX_STREAMS];
    struct tcp_stream *stream_of[3 + 3 * MAX_EXECS + MAX_STREAMS];
    int which[3 + 3 * MAX_EXECS + MAX_STREAMS];
    int port_idle = 0;
    for (;;) {
        int n = 0;
        pfds[n] = (struct pollfd){sfd, POLLIN, 0};
        owner[n++] = NULL;
        int audit_idx = -1;
        if (audit_fd >= 0) {
            audit_idx = n;
            pfds[n] = (struct pollfd){audit_fd, POLLIN, 0};
            owner[n++] = NULL;
        }
        int port_idx = -1;
        if (!port_idle) {
            port_idx = n;
            pfds[n] = (struct pollfd){port_fd, POLLIN, 0};
            owner[n++] = NULL;
        }
        int64_t now = now_ms();
        int64_t wake = port_idle ? now + 20 : -1;
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec_state *e = &execs[i];
            if (!e->used) continue;
            if (e->fd_out >= 0) {
                pfds[n] = (struct pollfd){e->fd_out, POLLIN, 0};
                owner[n] = e;
                which[n++] = 1;
            }
            if (e->fd_err >= 0) {
                pfds[n] = (struct pollfd){e->fd_err, POLLIN, 0};
                owner[n] = e;
                which[n++] = 2;
            }
            if (e->fd_in >= 0) {
                pfds[n] = (struct pollfd){e->fd_in, POLLOUT, 0};
                owner[n] = e;
                which[n++] = 0;
            }
            int64_t t = e->exited ? e->exit_ms + DRAIN_GRACE_MS : e->deadline_ms;
            if (t > 0 && (wake < 0 || t < wake)) wake = t;
        }
        int first_stream = n;
        for (int i = 0; i < MAX_STREAMS; i++) {
            struct tcp_stream *t = &streams[i];
            if (!t->used) continue;
            if (t->closing_ms && now >= t->closing_ms) {
                stream_free(t);
                continue;
            }
            if (t->closing_ms && (wake < 0 || t->closing_ms < wake)) wake = t->closing_ms;
            short ev = 0;
            if (t->connecting || t->wlen > 0) ev |= POLLOUT;
            if (!t->connecting && !t->closing_ms && !t->eof_sent && t->unacked < t->window) ev |= POLLIN;
            if (!ev) continue;
            pfds[n] = (struct pollfd){t->fd, ev, 0};
            owner[n] = NULL;
            stream_of[n++] = t;
        }
        if (tty_wanted && tty_pid == 0 && (wake < 0 || tty_respawn_ms < wake)) wake = tty_respawn_ms;
        int timeout = wake < 0 ? -1 : (int)(wake > now ? wake - now : 0);
        out_flush();
        int r = poll(pfds, (nfds_t)n, timeout);
        if (r < 0 && errno != EINTR) continue;
        port_idle = 0;
        for (int i = 0; r > 0 && i < n; i++) {
            if (!pfds[i].revents) continue;
            if (i == 0) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) > 0) {
                }
                reap();
            } else if (i == audit_idx) {
                read_guard_log();
            } else if (i == port_idx) {
                if (pfds[i].revents & POLLIN) {
                    if (!read_port()) port_idle = 1;
                } else {
                    port_idle = 1; /* POLLHUP: host not connected; poll again in 20 ms */
                }
            } else if (i >= first_stream) {
                struct tcp_stream *t = stream_of[i];
                if (!t->used || t->fd != pfds[i].fd) continue; /* freed by a request above */
                if (t->connecting) {
                    tcp_connected(t);
                    continue;
                }
                if (pfds[i].revents & POLLOUT) tcp_flush(t);
                if (pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) tcp_read(t);
            } else {
                struct exec_state *e = owner[i];
                if (!e->used) continue;
                if (which[i] == 0) {
                    ssize_t w = write(e->fd_in, e->stdin_buf + e->stdin_off, e->stdin_len - e->stdin_off);
                    if (w > 0) e->stdin_off += (size_t)w;
                    if ((w < 0 && errno != EAGAIN && errno != EINTR) || e->stdin_off >= e->stdin_len) {
                        close(e->fd_in);
                        e->fd_in = -1;
                    }
                } else {
                    exec_output(e, which[i]);
                }
            }
        }
        reap();
        now = now_ms();
        if (tty_wanted && tty_pid == 0 && now >= tty_respawn_ms) spawn_tty();
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec_state *e = &execs[i];
            if (!e->used) continue;
            if (!e->exited && e->deadline_ms > 0 && now >= e->deadline_ms && !e->timed_out) {
                e->timed_out = 1;
                kill_command(e);
            }
            if (e->exited && (e->fd_out >= 0 || e->fd_err >= 0)) exec_drain(e);
            if (e->exited && ((e->fd_out < 0 && e->fd_err < 0) || now >= e->exit_ms + DRAIN_GRACE_MS)) {
                exec_finish(e);
            }
        }
    }
}
