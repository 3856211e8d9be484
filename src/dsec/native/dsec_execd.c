/*
 * dsec_execd: the per-sandbox exec server of the dsec container tier.
 *
 * The edge forks it with one end of a SOCK_SEQPACKET socketpair. It lives in
 * the HOST pid namespace (so nothing in the sandbox can see, signal or ptrace
 * it) but joins the container's cgroups, its mount, ipc, uts, net and cgroup
 * namespaces, and its pid namespace for its children, through a pidfd of the
 * container's init. It then serves exec requests: for each it forks a child
 * (born in the container's cgroups and pid namespace) that enters a Landlock domain of its
 * own, setsid()s, applies the container's
 * rlimits, capability set, no_new_privs, user and seccomp filter (the same
 * policy the OCI runtime applied to the container, rendered by
 * dsec.runtimes.container.seccomp into the policy file), chdir()s and execs.
 * stdin/stdout/stderr are pipes the edge made and passed with SCM_RIGHTS.
 *
 * Usage: dsec_execd SOCK_FD POLICY_FILE [bpf=BPF_FILE] [setuid] [log] [auid=N]
 *        dsec_execd --bpf POLICY_FILE   (the compiled filter, raw, on stdout)
 *
 * With bpf=BPF_FILE (what --bpf wrote for the same policy) the server installs that
 * program instead of compiling the policy's deny rules with libseccomp: compiling is
 * most of a server's start-up CPU, and every sandbox starts one.
 *
 * With "setuid" (a sandbox created with allow_setuid) commands run without
 * no_new_privs, so setuid programs such as sudo work: the seccomp filter is then
 * installed while the child is still privileged (the kernel requires either
 * no_new_privs or CAP_SYS_ADMIN for that), before it drops to the command's user.
 * Such a program gains at most the capability set kept here (the bounding set).
 *
 * With "log" each command's filter is installed with SECCOMP_FILTER_FLAG_LOG: the kernel
 * reports every refused system call as an audit record (type 1326: pid, comm, syscall),
 * at no cost to the calls it allows. With "auid=N" the server sets its own loginuid to N
 * before it enters the container; every command inherits it, the records carry it as
 * auid=N, and the edge maps them to the sandbox even after the process has exited. A
 * command cannot change it (that takes CAP_AUDIT_CONTROL, never kept).
 *
 * Wire protocol (host byte order, one request or reply per datagram):
 *   request  = u32 type, u32 reserved, u64 id, body
 *     ATTACH (4): i32 init pid (host pid namespace), u32 count,
 *                 count NUL-terminated cgroup.procs paths to join. Must come first;
 *                 the server loads (or compiles) its policy while it waits for it.
 *     EXEC   (1): u32 uid, gid, ngroups, argc, envc, flags;
 *                 u32 groups[ngroups]; NUL-terminated cwd, argv[argc], env[envc];
 *                 exactly 3 fds (stdin, stdout, stderr) as SCM_RIGHTS.
 *                 flags bit 0 (EXEC_F_CTTY): fd 0 is a terminal (the slave of a pty
 *                 the edge opened); after setsid() the child makes it its controlling
 *                 terminal (TIOCSCTTY), so job control, ^C and SIGWINCH work.
 *     SIGNAL (2): i32 signo  -> killpg() of that exec's process group.
 *     RELEASE(3): forget the exec (the edge has its result, or gave up on it).
 *     REROOT (5): NUL-terminated hostname, u32 count, count entries of one type byte
 *                 ('d' directory, 'f' file) and a NUL-terminated absolute path;
 *                 exactly 1 fd: a detached mount (open_tree(OPEN_TREE_CLONE)) of a new
 *                 root. The container is moved onto it: it is attached at
 *                 /.dsec-reroot, each listed mount of the old root (those right below
 *                 it: /proc, /dev, /sys ...) is moved to the same path in it (made if
 *                 missing, never through a symbolic link), then pivot_root() moves
 *                 every process of the namespace (the init, this server) onto it and
 *                 the old root is detached; the hostname is set. Only before any
 *                 command ran (a warm container claimed as a fork's child). Replies
 *                 EXIT (0, 0, 0) or ERROR; on ERROR the container is unusable.
 *   reply    = u32 type, u32 reserved, u64 id, body
 *     READY  (100): i32 server pid (host pid namespace)
 *     STARTED(101): i32 child pid (host pid namespace)
 *     EXIT   (102): i32 wait status, i32 setup stage, i32 setup errno
 *                   (stage 0 = the command ran; otherwise the step that failed)
 *     ERROR  (103): i32 errno, char message[]
 *
 * Policy file lines (all numbers decimal):
 *   arch NAME                       seccomp architecture (x86_64, x86, x32 ...)
 *   deny SYSCALL ERRNO              fail the syscall with ERRNO
 *   deny_arg SYSCALL ERRNO IDX OP A B  same, only when arg IDX matches
 *                                   (OP: eq -> arg == A; masked_eq -> (arg & A) == B)
 *   cap N                           keep capability N (all others are dropped)
 *   rlimit RESOURCE SOFT HARD       setrlimit(); -1 means unlimited
 *
 * On end-of-file on the socket (the edge went away) every running exec's process
 * group is SIGKILLed and the server exits.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <malloc.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif

enum { EXEC_F_CTTY = 1u };
enum { T_EXEC = 1, T_SIGNAL = 2, T_RELEASE = 3, T_ATTACH = 4, T_REROOT = 5 };
enum { R_READY = 100, R_STARTED = 101, R_EXIT = 102, R_ERROR = 103 };
enum {
    STAGE_OK = 0, STAGE_CGROUP = 1 /* unused since the server joins once */, STAGE_SETSID = 2, STAGE_RLIMIT = 3, STAGE_BOUNDING = 4,
    STAGE_GROUPS = 5, STAGE_GID = 6, STAGE_UID = 7, STAGE_CAPSET = 8, STAGE_NNP = 9,
    STAGE_CHDIR = 10, STAGE_SECCOMP = 11, STAGE_EXEC = 12, STAGE_LANDLOCK = 13
};

#define MAX_MSG (4u << 20) /* 4 MiB: the edge caps argv at 1 MiB and env at 256 KiB */
#define MAX_CGROUPS 16
#define MAX_RLIMITS 16

struct hdr { uint32_t type; uint32_t reserved; uint64_t id; };
struct exec_body { uint32_t uid, gid, ngroups, argc, envc, flags; };

struct child {
    uint64_t id;
    pid_t pid;      /* host pid; also the process group id (the child setsid()s) */
    int errfd;      /* read end of the CLOEXEC error pipe */
    int exited;
    int released;   /* the edge no longer wants it: free as soon as it is reaped */
    struct child *next;
};

static int sock_fd = -1;
static int init_pidfd = -1;         /* pidfd of the container's init */
static struct sock_fprog filter;
static uint64_t keep_caps;          /* bit N set: keep capability N */
static int allow_setuid;            /* argument "setuid": no no_new_privs (sudo works) */
static unsigned seccomp_flags;      /* argument "log": SECCOMP_FILTER_FLAG_LOG (denials audited) */
static const char *audit_id;        /* argument "auid=N": this server's loginuid, inherited by
                                     * every command: the kernel's seccomp records name it */
/* The Landlock ruleset every command enters as a domain of its own (-1: the kernel has none):
 * the kernel lets a process open /proc/<pid>/mem (or ptrace) only of processes in its own
 * domain or one nested in it, so what one command leaves running cannot rewrite the memory
 * of a command started later, a grader say, even as the same user (docs/design/tenancy.md).
 * It restricts nothing else: it handles only the making of block devices, which the
 * container's device cgroup refuses anyway. */
static int command_domain_fd = -1;
static uint64_t ll_handled_fs;     /* what command_domain_fd's ruleset handles */
static int ll_abi;
static int cap_last = 40;
static struct { int res; struct rlimit lim; } rlimits[MAX_RLIMITS];
static int n_rlimits;
static int cgroup_fds[MAX_CGROUPS];
static int n_cgroups;
static struct child *children;
static char *msgbuf;

static void logmsg(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "dsec_execd[%d]: ", (int)getpid());
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void reply(uint32_t type, uint64_t id, const void *body, size_t len) {
    char buf[512];
    struct hdr h = {type, 0, id};
    if (len > sizeof(buf) - sizeof(h)) len = sizeof(buf) - sizeof(h);
    memcpy(buf, &h, sizeof(h));
    if (len) memcpy(buf + sizeof(h), body, len);
    /* MSG_NOSIGNAL: a vanished edge is seen as EOF in the poll loop, not SIGPIPE. */
    while (send(sock_fd, buf, sizeof(h) + len, MSG_NOSIGNAL) < 0 && errno == EINTR) {}
}

static void reply_error(uint64_t id, int err, const char *what) {
    char buf[256];
    int32_t e = err;
    memcpy(buf, &e, 4);
    int n = snprintf(buf + 4, sizeof(buf) - 4, "%s: %s", what, strerror(err));
    reply(R_ERROR, id, buf, 4 + (size_t)(n < 0 ? 0 : n) + 1);
}

static void die(const char *what) {
    int err = errno;
    logmsg("%s: %s", what, strerror(err));
    if (sock_fd >= 0) reply_error(0, err, what);
    _exit(1);
}

/* ---- policy ---------------------------------------------------------------- */

static int parse_op(const char *s, enum scmp_compare *op) {
    if (strcmp(s, "eq") == 0) { *op = SCMP_CMP_EQ; return 0; }
    if (strcmp(s, "masked_eq") == 0) { *op = SCMP_CMP_MASKED_EQ; return 0; }
    return -1;
}

/* The compiled program of the policy, from a file --bpf wrote: a whole number of
 * instructions, at most BPF_MAXINSNS. */
static void load_bpf(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) die("open bpf file");
    size_t cap = BPF_MAXINSNS * sizeof(struct sock_filter), len = 0;
    char *prog = malloc(cap + 1);
    if (!prog) die("malloc");
    for (;;) {
        ssize_t n = read(fd, prog + len, cap + 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) die("read bpf file");
        if (n == 0) break;
        len += (size_t)n;
        if (len > cap) break;
    }
    close(fd);
    if (len == 0 || len > cap || len % sizeof(struct sock_filter)) {
        errno = EINVAL;
        die("bad bpf file");
    }
    filter.len = (unsigned short)(len / sizeof(struct sock_filter));
    filter.filter = (struct sock_filter *)prog;
}

/* Read the policy file; its seccomp rules are compiled unless bpf_path gives the
 * program already compiled (then only its caps and rlimits are read). */
static void load_policy(const char *path, const char *bpf_path) {
    FILE *f = fopen(path, "re");
    if (!f) die("open policy file");
    scmp_filter_ctx ctx = NULL;
    if (!bpf_path) {
        ctx = seccomp_init(SCMP_ACT_ALLOW);
        if (!ctx) die("seccomp_init");
    }
    char line[512];
    int lineno = 0;
    while (fgets(line, sizeof(line), f)) {
        lineno++;
        char name[128], opname[32];
        int err, idx;
        long long soft, hard;
        unsigned long long a, b;
        if (line[0] == '#' || line[0] == '\n') continue;
        if (!ctx && (strncmp(line, "arch ", 5) == 0 || strncmp(line, "deny", 4) == 0))
            continue; /* compiled into the bpf file */
        if (sscanf(line, "arch %127s", name) == 1) {
            uint32_t arch = seccomp_arch_resolve_name(name);
            if (arch == 0) { errno = EINVAL; die("unknown seccomp architecture in policy"); }
            int rc = seccomp_arch_add(ctx, arch);
            if (rc < 0 && rc != -EEXIST) { errno = -rc; die("seccomp_arch_add"); }
        } else if (sscanf(line, "deny_arg %127s %d %d %31s %llu %llu", name, &err, &idx, opname, &a, &b) == 6) {
            enum scmp_compare op;
            if (parse_op(opname, &op) < 0) { errno = EINVAL; die("unknown compare op in policy"); }
            int nr = seccomp_syscall_resolve_name(name);
            if (nr == __NR_SCMP_ERROR) continue; /* unknown to this libseccomp: as crun does */
            struct scmp_arg_cmp cmp = {(unsigned)idx, op, a, b};
            int rc = seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO(err), nr, 1, &cmp);
            if (rc < 0) { errno = -rc; die("seccomp_rule_add (arg)"); }
        } else if (sscanf(line, "deny %127s %d", name, &err) == 2) {
            int nr = seccomp_syscall_resolve_name(name);
            if (nr == __NR_SCMP_ERROR) continue;
            int rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(err), nr, 0);
            if (rc < 0) { errno = -rc; die("seccomp_rule_add"); }
        } else if (sscanf(line, "cap %d", &idx) == 1) {
            if (idx < 0 || idx > 63) { errno = EINVAL; die("bad capability in policy"); }
            keep_caps |= 1ull << idx;
        } else if (sscanf(line, "rlimit %d %lld %lld", &idx, &soft, &hard) == 3) {
            if (n_rlimits >= MAX_RLIMITS) { errno = E2BIG; die("too many rlimits in policy"); }
            rlimits[n_rlimits].res = idx;
            rlimits[n_rlimits].lim.rlim_cur = soft < 0 ? RLIM_INFINITY : (rlim_t)soft;
            rlimits[n_rlimits].lim.rlim_max = hard < 0 ? RLIM_INFINITY : (rlim_t)hard;
            n_rlimits++;
        } else {
            logmsg("policy line %d not understood: %s", lineno, line);
            errno = EINVAL;
            die("bad policy file");
        }
    }
    fclose(f);
    if (!ctx) {
        load_bpf(bpf_path);
        return;
    }
    /* Compile once; each child only installs the ready BPF program (~10 us). */
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) die("pipe2");
    fcntl(p[1], F_SETPIPE_SZ, 1 << 20);
    int rc = seccomp_export_bpf(ctx, p[1]);
    if (rc < 0) { errno = -rc; die("seccomp_export_bpf"); }
    close(p[1]);
    size_t cap = 4096, len = 0;
    char *prog = malloc(cap);
    for (;;) {
        if (len == cap) prog = realloc(prog, cap *= 2);
        if (!prog) die("malloc");
        ssize_t n = read(p[0], prog + len, cap - len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) die("read bpf");
        if (n == 0) break;
        len += (size_t)n;
    }
    close(p[0]);
    filter.len = (unsigned short)(len / sizeof(struct sock_filter));
    filter.filter = (struct sock_filter *)prog;
    seccomp_release(ctx);
    /* libseccomp's rule database is freed but stays in the heap (~240 kB): give it back.
     * The server lives as long as its sandbox, so this is memory per idle sandbox. */
    malloc_trim(0);
}

/* The seccomp filter of a command: with "log", every refusal is also reported to the
 * kernel's audit stream (type 1326 records naming the loginuid set by "auid="), which the
 * edge reads (dsec.privileged.seccomp_log); without it, as prctl(PR_SET_SECCOMP) does. */
static int install_filter(void) {
    return (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, seccomp_flags, &filter);
}

/* ---- the child ------------------------------------------------------------- */

static void child_fail(int errfd, int stage) {
    int32_t rec[2] = {stage, errno};
    ssize_t w = write(errfd, rec, sizeof(rec));
    (void)w;
    _exit(127);
}

/* execvp's search, with the PATH of the command's own environment (envp), writing no
 * memory but this frame's: the child runs in the server's memory (vfork) until it execs.
 * As execvp: a name with a '/' is executed as is; otherwise each PATH entry is tried,
 * ENOENT/ENOTDIR/ENAMETOOLONG go on to the next, EACCES is remembered and reported if
 * nothing else is found, any other error stops the search. A file that is not a valid
 * executable (ENOEXEC) runs as a script of /bin/sh, as execvp does. */
static void exec_path(char **argv, char **envp) {
    const char *file = argv[0];
    if (!*file) { errno = ENOENT; return; }
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        return;
    }
    const char *path = "/usr/local/bin:/bin:/usr/bin"; /* glibc's default without PATH */
    for (char **e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) { path = *e + 5; break; }
    size_t flen = strlen(file);
    char buf[4096];
    int saw_eacces = 0;
    for (const char *p = path;; p++) {
        const char *end = strchrnul(p, ':');
        size_t dlen = (size_t)(end - p);
        if (dlen + 1 + flen < sizeof(buf)) {
            if (dlen) memcpy(buf, p, dlen); /* an empty entry is the current directory */
            else buf[dlen++] = '.';
            buf[dlen] = '/';
            memcpy(buf + dlen + 1, file, flen + 1);
            execve(buf, argv, envp);
            if (errno == ENOEXEC) {
                size_t argc = 0;
                while (argv[argc]) argc++;
                if (argc < 4096) {
                    char *sh[argc + 2];
                    sh[0] = (char *)"/bin/sh";
                    sh[1] = buf;
                    for (size_t i = 1; i <= argc; i++) sh[i + 1] = argv[i];
                    execve("/bin/sh", sh, envp);
                }
                return;
            }
            if (errno == EACCES) saw_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR && errno != ENAMETOOLONG) return;
        }
        if (!*end) break;
        p = end;
    }
    errno = saw_eacces ? EACCES : ENOENT;
}

static void run_child(int errfd, const int fds[3], uint32_t flags, uid_t uid, gid_t gid,
                      uint32_t ngroups, const gid_t *groups, const char *cwd, char **argv,
                      char **envp) {
    /* Every signal at its default, as posix_spawn's SETSIGDEF does: a disposition the
     * server inherited as ignored (SIGINT and SIGQUIT of a server started as a background
     * job of a shell) would otherwise survive exec, and a command could not be stopped
     * with Ctrl-C (bash cannot even trap a signal it found ignored). Blocked meanwhile,
     * so no handler of the server runs in its borrowed memory; unblocked just before exec. */
    sigset_t all, none;
    sigfillset(&all);
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &all, NULL);
    /* first, while still privileged (no_new_privs is not needed then, and a setuid sandbox
     * has none) */
    if (command_domain_fd >= 0 && syscall(SYS_landlock_restrict_self, command_domain_fd, 0) < 0)
        child_fail(errfd, STAGE_LANDLOCK);
    /* the raw syscall: glibc's sigaction refuses its own signals 32 and 33, which a
     * parent may have left ignored too */
    struct { void *handler; unsigned long flags; void *restorer; uint64_t mask; } dfl = {0};
    dfl.handler = (void *)SIG_DFL;
    for (int s = 1; s <= 64; s++)
        if (s != SIGKILL && s != SIGSTOP) syscall(SYS_rt_sigaction, s, &dfl, NULL, 8);

    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], i) < 0) child_fail(errfd, STAGE_SETSID);
    /* Keep only 0-2 and the error pipe (CLOEXEC, closes on a successful exec). */
    if (errfd > 3) syscall(SYS_close_range, 3, errfd - 1, 0);
    syscall(SYS_close_range, errfd + 1, ~0u, 0);
    if (setsid() < 0) child_fail(errfd, STAGE_SETSID);
    if ((flags & EXEC_F_CTTY) && ioctl(0, TIOCSCTTY, 0) < 0) child_fail(errfd, STAGE_SETSID);
    for (int i = 0; i < n_rlimits; i++)
        if (setrlimit(rlimits[i].res, &rlimits[i].lim) < 0) child_fail(errfd, STAGE_RLIMIT);
    for (int c = 0; c <= cap_last; c++)
        if (!(keep_caps & (1ull << c)) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL)
            child_fail(errfd, STAGE_BOUNDING);
    /* without no_new_privs only a privileged process may install the filter: do it now,
     * while the child is still root with its effective capabilities */
    if (allow_setuid && filter.len && install_filter() < 0)
        child_fail(errfd, STAGE_SECCOMP);
    if (setgroups(ngroups, groups) < 0) child_fail(errfd, STAGE_GROUPS);
    if (setresgid(gid, gid, gid) < 0) child_fail(errfd, STAGE_GID);
    if (setresuid(uid, uid, uid) < 0) child_fail(errfd, STAGE_UID);
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    uint64_t caps = uid == 0 ? keep_caps : 0;
    for (int i = 0; i < 2; i++) {
        d[i].effective = d[i].permitted = d[i].inheritable = (uint32_t)(caps >> (32 * i));
    }
    if (syscall(SYS_capset, &h, d) < 0) child_fail(errfd, STAGE_CAPSET);
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    if (!allow_setuid && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) child_fail(errfd, STAGE_NNP);
    if (chdir(cwd) < 0) child_fail(errfd, STAGE_CHDIR);
    if (!allow_setuid && filter.len && install_filter() < 0)
        child_fail(errfd, STAGE_SECCOMP);
    sigprocmask(SIG_SETMASK, &none, NULL);
    exec_path(argv, envp);
    child_fail(errfd, STAGE_EXEC);
}

/* ---- request handling ---------------------------------------------------- */

static struct child *find_child(uint64_t id) {
    for (struct child *c = children; c; c = c->next)
        if (c->id == id) return c;
    return NULL;
}

static void close_fds(const int *fds, int n) {
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0) close(fds[i]);
}

static void handle_exec(uint64_t id, const char *body, size_t len, int *fds, int nfds) {
    struct exec_body eb;
    if (nfds != 3 || len < sizeof(eb)) {
        close_fds(fds, nfds);
        reply_error(id, EINVAL, "exec request needs a header and exactly 3 fds");
        return;
    }
    memcpy(&eb, body, sizeof(eb));
    size_t off = sizeof(eb);
    if (eb.ngroups > 65536 || eb.argc == 0 || eb.argc > 1u << 20 || eb.envc > 1u << 20 ||
        off + (size_t)eb.ngroups * 4 > len) {
        close_fds(fds, nfds);
        reply_error(id, EINVAL, "bad exec request counts");
        return;
    }
    gid_t *groups = calloc(eb.ngroups + 1, sizeof(gid_t));
    char **argv = calloc(eb.argc + 1, sizeof(char *));
    char **envp = calloc(eb.envc + 1, sizeof(char *));
    if (!groups || !argv || !envp) {
        free(groups); free(argv); free(envp);
        close_fds(fds, nfds);
        reply_error(id, ENOMEM, "exec request");
        return;
    }
    for (uint32_t i = 0; i < eb.ngroups; i++) {
        uint32_t g;
        memcpy(&g, body + off, 4);
        groups[i] = g;
        off += 4;
    }
    const char *cwd = NULL;
    uint32_t want = 1 + eb.argc + eb.envc, got = 0;
    const char *p = body + off, *end = body + len;
    while (got < want && p < end) {
        const char *nul = memchr(p, '\0', (size_t)(end - p));
        if (!nul) break;
        if (got == 0) cwd = p;
        else if (got <= eb.argc) argv[got - 1] = (char *)p;
        else envp[got - 1 - eb.argc] = (char *)p;
        got++;
        p = nul + 1;
    }
    if (got != want) {
        free(groups); free(argv); free(envp);
        close_fds(fds, nfds);
        reply_error(id, EINVAL, "exec request strings truncated");
        return;
    }
    int ep[2];
    if (pipe2(ep, O_CLOEXEC) < 0) {
        int e = errno;
        free(groups); free(argv); free(envp);
        close_fds(fds, nfds);
        reply_error(id, e, "pipe2");
        return;
    }
    struct child *c = calloc(1, sizeof(*c));
    /* vfork: the child borrows this process's memory until it execs (or fails and
     * _exit()s), so no page table is copied (fork cost ~0.5 ms here, a third of an exec
     * of `true`). run_child writes only its own stack frame and per-task state (fds,
     * credentials, limits, seccomp, cwd), never a global, and never returns. */
    pid_t pid = c ? vfork() : -1;
    if (pid == 0) {
        run_child(ep[1], fds, eb.flags, eb.uid, eb.gid, eb.ngroups, groups, cwd, argv, envp);
    }
    int e = errno;
    close(ep[1]);
    close_fds(fds, nfds);
    free(groups); free(argv); free(envp);
    if (pid < 0) {
        close(ep[0]);
        free(c);
        reply_error(id, c ? e : ENOMEM, "fork");
        return;
    }
    c->id = id;
    c->pid = pid;
    c->errfd = ep[0];
    c->next = children;
    children = c;
    int32_t p32 = pid;
    reply(R_STARTED, id, &p32, 4);
}

static void handle_signal(uint64_t id, const char *body, size_t len) {
    int32_t sig;
    struct child *c = find_child(id);
    if (!c || len < 4) return;
    memcpy(&sig, body, 4);
    if (c->exited) {
        /* The leader is gone; signal the group only if no live exec reuses its number. */
        for (struct child *o = children; o; o = o->next)
            if (!o->exited && o->pid == c->pid) return;
    }
    /* Right after fork the child may not have called setsid() yet: no such group then,
     * so signal the child itself (its setsid() and exec come after, or never). */
    if (killpg(c->pid, sig) < 0 && errno == ESRCH && !c->exited) kill(c->pid, sig);
}

static void handle_release(uint64_t id) {
    for (struct child **pp = &children; *pp; pp = &(*pp)->next) {
        struct child *c = *pp;
        if (c->id != id) continue;
        if (c->exited) {
            *pp = c->next;
            free(c);
        } else {
            c->released = 1; /* freed when reaped */
        }
        return;
    }
}

static void reap(void) {
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) return;
        for (struct child **pp = &children; *pp; pp = &(*pp)->next) {
            struct child *c = *pp;
            if (c->pid != pid || c->exited) continue;
            int32_t body[3] = {status, 0, 0};
            int32_t rec[2];
            if (read(c->errfd, rec, sizeof(rec)) == (ssize_t)sizeof(rec)) {
                body[1] = rec[0];
                body[2] = rec[1];
            }
            close(c->errfd);
            c->errfd = -1;
            c->exited = 1;
            if (c->released) {
                *pp = c->next;
                free(c);
            } else {
                reply(R_EXIT, c->id, body, sizeof(body));
            }
            break;
        }
    }
}

/* The edge went away (or is destroying the sandbox): kill every running exec's process
 * group and reap the children before leaving. Orphaned, they would be handed to the edge
 * (a child subreaper, outside the container's pid namespace), and until the edge reaped
 * them the container's init could not finish exiting (a dying pid-namespace init waits
 * for every process of its namespace to be reaped). Bounded: 1.5 s (the edge waits 2 s
 * for this server), then whatever is still dying is left to the edge. */
static void kill_all_and_exit(void) {
    for (struct child *c = children; c; c = c->next) {
        if (c->exited) continue;
        killpg(c->pid, SIGKILL);
        kill(c->pid, SIGKILL); /* just forked: it may not have called setsid() yet */
    }
    for (int i = 0; i < 1500; i++) {
        pid_t pid = waitpid(-1, NULL, WNOHANG);
        if (pid < 0 && errno == ECHILD) break; /* none left */
        if (pid > 0) continue;
        struct timespec ms = {0, 1000 * 1000};
        nanosleep(&ms, NULL);
    }
    _exit(0);
}

static int add_refer_beneath_root(int ruleset_fd);

/* From Landlock ABI 2 the commands' ruleset must grant REFER beneath the root they see
 * (add_refer_beneath_root): granted, or no ruleset at all (a domain refusing renames
 * would break commands). */
static void grant_refer(int ruleset_fd) {
    if (ruleset_fd >= 0 && ll_abi >= 2 && add_refer_beneath_root(ruleset_fd) < 0) {
        close(ruleset_fd);
        command_domain_fd = -1;
    }
}

/* ---- reroot (a warm container becomes a fork's child) ---------------------- */

#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define MOVE_MOUNT_F_EMPTY_PATH_ 0x00000004
#define MOVE_MOUNT_T_EMPTY_PATH_ 0x00000040
#define RESOLVE_NO_MAGICLINKS_ 0x02
#define RESOLVE_NO_SYMLINKS_ 0x04
#define RESOLVE_BENEATH_ 0x08
#define REROOT_AT "/.dsec-reroot"

struct open_how_ { uint64_t flags, mode, resolve; };

static int open_beneath(int dirfd, const char *rel, int flags, mode_t mode) {
    struct open_how_ how = {(uint64_t)(flags | O_CLOEXEC), mode,
                            RESOLVE_BENEATH_ | RESOLVE_NO_SYMLINKS_ | RESOLVE_NO_MAGICLINKS_};
    return (int)syscall(SYS_openat2, dirfd, rel, &how, sizeof(how));
}

/* The mount point ``path`` (absolute) under the new root ``rootfd``, made if missing
 * (``type`` 'd': a directory, else a file; parents as directories): an O_PATH fd of it.
 * Nothing is resolved through a symbolic link or out of the new root: its files are
 * what a sandbox wrote (the fork's parent). -1 with errno set on failure. */
static int mountpoint_beneath(int rootfd, char type, const char *path) {
    char buf[4096];
    size_t len = strlen(path);
    if (path[0] != '/' || len >= sizeof(buf) || strstr(path, "/../") || strstr(path, "/./")) {
        errno = EINVAL;
        return -1;
    }
    memcpy(buf, path, len + 1);
    int dir = dup(rootfd);
    if (dir < 0) return -1;
    char *comp = buf + 1;
    for (;;) {
        char *slash = strchr(comp, '/');
        if (slash) *slash = '\0';
        int last = !slash || !slash[1];
        if (*comp == '\0') { close(dir); errno = EINVAL; return -1; }
        if (last && type != 'd') {
            /* never opened for writing if it exists (a FIFO would block) */
            int f = open_beneath(dir, comp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644);
            if (f < 0 && errno == EEXIST) f = open_beneath(dir, comp, O_PATH | O_NOFOLLOW, 0);
            if (f >= 0) {
                struct stat st;
                if (fstat(f, &st) < 0 || !S_ISREG(st.st_mode)) { close(f); f = -1; errno = ENOTDIR; }
            }
            close(dir);
            return f;
        }
        if (mkdirat(dir, comp, 0755) < 0 && errno != EEXIST) { close(dir); return -1; }
        int next = open_beneath(dir, comp, O_PATH | O_DIRECTORY | O_NOFOLLOW, 0);
        close(dir);
        if (next < 0) return -1;
        dir = next;
        if (last) return dir;
        comp = slash + 1;
    }
}

static void handle_reroot(uint64_t id, const char *body, size_t len, int *fds, int nfds) {
    if (nfds != 1) {
        close_fds(fds, nfds);
        reply_error(id, EINVAL, "reroot needs exactly 1 fd");
        return;
    }
    int newfd = fds[0];
    const char *end = body + len, *host = body;
    const char *nul = memchr(body, '\0', len);
    uint32_t count = 0;
    const char *what = "reroot request";
    if (!nul || (size_t)(end - nul - 1) < 4) { errno = EINVAL; goto fail; }
    memcpy(&count, nul + 1, 4);
    const char *p = nul + 5;
    /* the new root, attached below the old one (which goes, with this directory) */
    what = "mkdir " REROOT_AT;
    if (mkdir(REROOT_AT, 0700) < 0 && errno != EEXIST) goto fail;
    what = "attach the new root";
    if (syscall(SYS_move_mount, newfd, "", AT_FDCWD, REROOT_AT, MOVE_MOUNT_F_EMPTY_PATH_) < 0) goto fail;
    what = "make the new root private";
    if (mount(NULL, REROOT_AT, NULL, MS_PRIVATE | MS_REC, NULL) < 0) goto fail;
    for (uint32_t i = 0; i < count; i++) {
        what = "reroot request mounts";
        if (end - p < 2) { errno = EINVAL; goto fail; }
        char type = *p++;
        const char *mnul = memchr(p, '\0', (size_t)(end - p));
        if (!mnul) { errno = EINVAL; goto fail; }
        what = p;
        int target = mountpoint_beneath(newfd, type, p);
        if (target < 0) goto fail;
        long rc = syscall(SYS_move_mount, AT_FDCWD, p, target, "", MOVE_MOUNT_T_EMPTY_PATH_);
        close(target);
        if (rc < 0) goto fail;
        p = mnul + 1;
    }
    /* every process whose root or cwd is the old root (the init, this server) moves */
    what = "pivot_root";
    if (fchdir(newfd) < 0 || syscall(SYS_pivot_root, ".", ".") < 0) goto fail;
    what = "detach the old root";
    if (mount(NULL, ".", NULL, MS_PRIVATE | MS_REC, NULL) < 0 || umount2(".", MNT_DETACH) < 0 ||
        chdir("/") < 0)
        goto fail;
    close(newfd);
    newfd = -1;
    what = "sethostname";
    if (sethostname(host, strlen(host)) < 0) goto fail;
    /* the commands' REFER grant named the old root: a new ruleset for the new one */
    if (command_domain_fd >= 0) {
        close(command_domain_fd);
        command_domain_fd = (int)syscall(SYS_landlock_create_ruleset, &ll_handled_fs, sizeof ll_handled_fs, 0);
        grant_refer(command_domain_fd);
    }
    int32_t ok[3] = {0, 0, 0};
    reply(R_EXIT, id, ok, sizeof(ok));
    return;
fail:;
    int e = errno;
    if (newfd >= 0) close(newfd);
    reply_error(id, e, what);
}

static void serve(void) {
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) die("signalfd");
    int32_t me = getpid();
    reply(R_READY, 0, &me, 4);
    char cbuf[CMSG_SPACE(sizeof(int) * 8)];
    for (;;) {
        struct pollfd pf[2] = {{sock_fd, POLLIN, 0}, {sfd, POLLIN, 0}};
        if (poll(pf, 2, -1) < 0) {
            if (errno == EINTR) continue;
            die("poll");
        }
        if (pf[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {}
            reap();
        }
        if (!(pf[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        struct iovec iov = {msgbuf, MAX_MSG};
        struct msghdr mh = {0};
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof(cbuf);
        ssize_t n = recvmsg(sock_fd, &mh, MSG_CMSG_CLOEXEC);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n <= 0) kill_all_and_exit();
        int fds[8], nfds = 0;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
            int cnt = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < cnt && nfds < 8; i++) memcpy(&fds[nfds++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        }
        struct hdr h;
        if ((size_t)n < sizeof(h) || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
            close_fds(fds, nfds);
            reply_error(0, EMSGSIZE, "request truncated");
            continue;
        }
        memcpy(&h, msgbuf, sizeof(h));
        const char *body = msgbuf + sizeof(h);
        size_t blen = (size_t)n - sizeof(h);
        switch (h.type) {
        case T_EXEC: handle_exec(h.id, body, blen, fds, nfds); break;
        case T_SIGNAL: close_fds(fds, nfds); handle_signal(h.id, body, blen); break;
        case T_RELEASE: close_fds(fds, nfds); handle_release(h.id); break;
        case T_REROOT: handle_reroot(h.id, body, blen, fds, nfds); break;
        default: close_fds(fds, nfds); reply_error(h.id, EINVAL, "unknown request type");
        }
        if (n > (1 << 16)) madvise(msgbuf, MAX_MSG, MADV_DONTNEED); /* give big pages back */
    }
}

/* Wait for the ATTACH request (the server is started while the OCI runtime is still
 * creating the container, so its own start-up and policy compilation cost nothing on
 * the creation path), then enter the container. */
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

static void attach(void) {
    char cbuf[CMSG_SPACE(sizeof(int) * 8)];
    struct iovec iov = {msgbuf, MAX_MSG};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof(cbuf);
    ssize_t n;
    do n = recvmsg(sock_fd, &mh, MSG_CMSG_CLOEXEC); while (n < 0 && errno == EINTR);
    if (n == 0) _exit(0); /* the edge gave up on this sandbox */
    struct hdr h;
    if (n < (ssize_t)(sizeof(h) + 8)) { errno = EPROTO; die("attach request"); }
    memcpy(&h, msgbuf, sizeof(h));
    if (h.type != T_ATTACH) { errno = EPROTO; die("expected an attach request"); }
    int32_t init_pid;
    uint32_t count;
    memcpy(&init_pid, msgbuf + sizeof(h), 4);
    memcpy(&count, msgbuf + sizeof(h) + 4, 4);
    const char *p = msgbuf + sizeof(h) + 8, *end = msgbuf + n;
    for (uint32_t i = 0; i < count; i++) {
        const char *nul = memchr(p, '\0', (size_t)(end - p));
        if (!nul) { errno = EPROTO; die("attach request strings"); }
        if (n_cgroups >= MAX_CGROUPS) { errno = E2BIG; die("too many cgroups"); }
        int fd = open(p, O_WRONLY | O_CLOEXEC);
        if (fd < 0) die(p);
        cgroup_fds[n_cgroups++] = fd;
        p = nul + 1;
    }
    init_pidfd = (int)syscall(SYS_pidfd_open, init_pid, 0);
    if (init_pidfd < 0) die("pidfd_open of the container init");
    /* Join the container's cgroups once, here: every child is then born in them (a
     * per-exec migration costs ~0.8 ms over 11 v1 hierarchies). Cgroups first, then the
     * cgroup namespace, so that our cgroup is inside the namespace's root. */
    for (int i = 0; i < n_cgroups; i++) {
        if (write(cgroup_fds[i], "0", 1) != 1) die("joining the container's cgroups");
        close(cgroup_fds[i]);
    }
    if (setns(init_pidfd, CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET |
                              CLONE_NEWCGROUP) < 0)
        die("setns into the container");
    close(init_pidfd);
    /* /dev/shm is a directory of the container's /dev tmpfs, not a tmpfs of its own: every
     * superblock on the host costs every memory cgroup (bundle.py, SUPERBLOCKS_NOTE). Made
     * here, before READY, so that no command ever runs without it. */
    if (mkdir("/dev/shm", 01777) == 0) chmod("/dev/shm", 01777);
}

/* dsec_execd --bpf POLICY_FILE: write the policy's compiled seccomp program (raw
 * struct sock_filter array) to stdout and exit; what the OCI runtime is handed, so that
 * it does not compile the same rules again for every container. */
static int export_bpf(const char *policy) {
    load_policy(policy, NULL);
    size_t len = filter.len * sizeof(struct sock_filter);
    const char *p = (const char *)filter.filter;
    while (len) {
        ssize_t n = write(1, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return 1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--bpf") == 0) return export_bpf(argv[2]);
    const char *bpf_path = NULL;
    int usage = argc < 3;
    for (int i = 3; i < argc; i++) {
        if (strcmp(argv[i], "setuid") == 0) allow_setuid = 1;
        else if (strncmp(argv[i], "bpf=", 4) == 0 && argv[i][4]) bpf_path = argv[i] + 4;
        else if (strcmp(argv[i], "log") == 0) seccomp_flags |= SECCOMP_FILTER_FLAG_LOG;
        else if (strncmp(argv[i], "auid=", 5) == 0 && argv[i][5]) audit_id = argv[i] + 5;
        else usage = 1;
    }
    if (usage) {
        fprintf(stderr, "usage: %s SOCK_FD POLICY_FILE [bpf=BPF_FILE] [setuid] [log] [auid=N]\n", argv[0]);
        return 2;
    }
    sock_fd = atoi(argv[1]);
    prctl(PR_SET_NAME, "dsec-execd", 0, 0, 0);
    msgbuf = malloc(MAX_MSG);
    if (!msgbuf) die("malloc");
    load_policy(argv[2], bpf_path);
    if (audit_id) { /* still in the node's mount namespace: its /proc */
        int fd = open("/proc/self/loginuid", O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, audit_id, strlen(audit_id)) < 0)
            logmsg("cannot set the audit id (denials are then found by process): %s", strerror(errno));
        if (fd >= 0) close(fd);
    }
    ll_abi = landlock_abi_version();
    ll_handled_fs = 1ull << 11; /* LANDLOCK_ACCESS_FS_MAKE_BLOCK (ABI 1) */
    if (ll_abi >= 2) ll_handled_fs |= 1ull << 13; /* REFER: granted below, after attach */
    command_domain_fd = (int)syscall(SYS_landlock_create_ruleset, &ll_handled_fs, sizeof ll_handled_fs, 0);
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
    if (f) {
        if (fscanf(f, "%d", &cap_last) != 1) cap_last = 40;
        fclose(f);
    }
    attach();
    /* in the container's mount namespace now: its root is what the commands see */
    grant_refer(command_domain_fd);
    serve();
    return 0;
}
