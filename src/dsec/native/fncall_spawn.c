/*
 * fncall_spawn: what every exec'd command of a fncall worker runs through between the agent's
 * vfork and the command itself. The agent is Python: a hook run after its fork (preexec_fn)
 * makes it fork instead of vfork, which copies its address space (~2-4 ms per command on this
 * kind of VM); this helper is one exec of a few kilobytes (~0.1 ms).
 *
 *   /dev/.dsec-spawn DOMAIN_FD PROCS_FD -- PROGRAM ARGS...   run PROGRAM now
 *   /dev/.dsec-spawn DOMAIN_FD PROCS_FD REQUEST_FD           run what REQUEST_FD says
 *   (fncall_launch binds it at /dev/.dsec-spawn)
 *
 * In order, a step that fails ends the command with exit status 126 and a message on stderr:
 *   1. DOMAIN_FD >= 0: landlock_restrict_self() with that ruleset, then closed: the command is
 *      a Landlock domain of its own, so no process of another command can open its
 *      /proc/<pid>/mem (the agent has set no_new_privs; docs/design/tenancy.md);
 *   2. PROCS_FD >= 0: "0" written to it, then closed: the cgroup.procs of the command's own
 *      pids cgroup, whose limit leaves the worker a reserve for the next command. Moving a
 *      process between v1 cgroups waits for an RCU grace period when none moved lately
 *      (~14 ms here): the agent starts the next command's helper ahead, right after a
 *      command ends, and it waits in its cgroup for the command (the second form);
 *   3. oom_score_adj raised to 1000 (no privilege needed): the OOM killer takes a command
 *      before the agent (0, or -941 where root may lower it; it can lower its own to 0,
 *      not below);
 *   4. second form: the request read from REQUEST_FD up to end of file (nothing: exit 0):
 *      u32 argc, u32 envc (host order), then NUL-terminated cwd, argv[argc], env[envc];
 *      chdir(cwd);
 *   5. PROGRAM executed as execvp() does: searched in the PATH of the command's environment,
 *      a file without #! run by /bin/sh; 127 if it does not exist, else 126, with
 *      "PROGRAM: reason" on stderr.
 * Nothing else of the process changes.
 *
 * Freestanding (x86-64, no libc: built with -nostdlib -static): a static glibc binary costs
 * ~0.7 ms more per exec here, a third of a command's round trip.
 */
typedef unsigned long size_t;

#define SYS_read 0
#define SYS_write 1
#define SYS_close 3
#define SYS_execve 59
#define SYS_chdir 80
#define SYS_open 2
#define O_WRONLY 1
#define O_CLOEXEC 02000000
#define SYS_exit_group 231
#define SYS_landlock_restrict_self 446
#define ENOENT 2
#define ENOEXEC 8
#define EACCES 13
#define ENOTDIR 20
#define EINTR 4
#define PATH_MAX 4096
#define MAX_REQUEST (8u << 20)         /* the edge caps argv at 1 MiB and env at 256 KiB */
#define MAX_STRINGS (MAX_REQUEST / 8)  /* pointers: argv and env together */

static char request[MAX_REQUEST];
static char *strings[MAX_STRINGS + 2];

static long sys3(long n, long a, long b, long c) {
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
}

static size_t len(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}

static void say(const char *s) { sys3(SYS_write, 2, (long)s, (long)len(s)); }

static const char *reason(long err) {
    switch (err) {
    case 1: return "Operation not permitted";
    case ENOENT: return "No such file or directory";
    case 7: return "Argument list too long";
    case ENOEXEC: return "Exec format error";
    case 9: return "Bad file descriptor";
    case 12: return "Cannot allocate memory";
    case EACCES: return "Permission denied";
    case ENOTDIR: return "Not a directory";
    case 22: return "Invalid argument";
    case 26: return "Text file busy";
    case 36: return "File name too long";
    case 38: return "Function not implemented";
    case 40: return "Too many levels of symbolic links";
    default: return "failed";
    }
}

static void __attribute__((noreturn)) finish(int code) {
    for (;;) sys3(SYS_exit_group, code, 0, 0);
}

static void __attribute__((noreturn)) fail(const char *what, long err) {
    say(what);
    say(": ");
    say(reason(err));
    say("\n");
    finish(err == ENOENT ? 127 : 126);
}

/* A descriptor number argument; -1 for "-1" (none) or anything not a number. */
static long fd_arg(const char *s) {
    if (*s < '0' || *s > '9') return -1;
    long n = 0;
    for (; *s >= '0' && *s <= '9'; s++) n = n * 10 + (*s - '0');
    return n;
}

/* execve(path); on ENOEXEC (no #!), run it as a script of /bin/sh as execvp does. Returns
 * the error. */
static long try_exec(const char *path, char **argv, char **envp) {
    long err = -sys3(SYS_execve, (long)path, (long)argv, (long)envp);
    if (err != ENOEXEC) return err;
    int argc = 0;
    while (argv[argc]) argc++;
    if (argc > 4096) return 7;
    char *sh[argc + 2];
    sh[0] = (char *)"/bin/sh";
    sh[1] = (char *)path;
    for (int i = 1; i <= argc; i++) sh[i + 1] = argv[i];
    return -sys3(SYS_execve, (long)"/bin/sh", (long)sh, (long)envp);
}

/* execvp(cmd[0], cmd) with the PATH of envp; does not return. */
static void __attribute__((noreturn)) run(char **cmd, char **envp) {
    const char *file = cmd[0];
    size_t flen = len(file);
    int slash = 0;
    for (const char *p = file; *p; p++) slash |= *p == '/';
    if (slash || !flen) fail(file, flen ? try_exec(file, cmd, envp) : ENOENT);
    const char *path = "/usr/local/bin:/usr/bin:/bin";
    for (char **e = envp; *e; e++) {
        const char *v = *e;
        if (v[0] == 'P' && v[1] == 'A' && v[2] == 'T' && v[3] == 'H' && v[4] == '=') path = v + 5;
    }
    long err = ENOENT;
    int eacces = 0;
    char buf[PATH_MAX];
    for (const char *p = path;; p++) {
        const char *q = p;
        while (*q && *q != ':') q++;
        size_t dlen = (size_t)(q - p);
        if (dlen + flen + 2 <= sizeof buf) {
            size_t off = 0;
            for (; off < dlen; off++) buf[off] = p[off];
            if (dlen) buf[off++] = '/';
            for (size_t i = 0; i <= flen; i++) buf[off + i] = file[i];
            long e = try_exec(buf, cmd, envp);
            if (e == EACCES)
                eacces = 1;
            else if (e != ENOENT && e != ENOTDIR)
                err = e;
        }
        if (!*q) break;
        p = q;
    }
    fail(file, eacces && err == ENOENT ? EACCES : err);
}

/* The second form: read the request, chdir, run it. */
static void __attribute__((noreturn)) serve(long fd) {
    size_t got = 0;
    for (;;) {
        long n = sys3(SYS_read, fd, (long)(request + got), (long)(sizeof request - got));
        if (n == -EINTR) continue;
        if (n < 0) fail("dsec: reading the command", -n);
        if (n == 0) break;
        got += (size_t)n;
        if (got == sizeof request) fail("dsec: the command", 7);
    }
    sys3(SYS_close, fd, 0, 0);
    if (got == 0) finish(0); /* not used after all */
    unsigned argc = 0, envc = 0;
    if (got < 8) fail("dsec: the command", 22);
    for (int i = 0; i < 4; i++) {
        argc |= (unsigned)(unsigned char)request[i] << (8 * i);
        envc |= (unsigned)(unsigned char)request[4 + i] << (8 * i);
    }
    if (argc == 0 || argc > MAX_STRINGS || envc > MAX_STRINGS - argc) fail("dsec: the command", 22);
    /* cwd, then argc + envc strings, each NUL-terminated, exactly filling the request */
    char *p = request + 8, *end = request + got, *cwd = p;
    size_t want = 1 + argc + envc, n = 0;
    for (char *q = p; q < end && n < want; q++) {
        if (*q) continue;
        if (n > 0) strings[n - 1 + (n > argc ? 1 : 0)] = p;
        n++;
        p = q + 1;
    }
    if (n != want || p != end) fail("dsec: the command", 22);
    char **cmd = strings, **env = strings + argc + 1;
    cmd[argc] = 0;
    env[envc] = 0;
    long rc = sys3(SYS_chdir, (long)cwd, 0, 0);
    if (rc < 0) {
        say("dsec: cwd ");
        say(cwd);
        say(": ");
        say(reason(-rc));
        say("\n");
        finish(126);
    }
    run(cmd, env);
}

static void __attribute__((noreturn, used)) start(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1), **envp = argv + argc + 1;
    int direct = argc >= 5 && argv[3][0] == '-' && argv[3][1] == '-' && !argv[3][2];
    if (!direct && argc != 4) {
        say("usage: fncall_spawn DOMAIN_FD PROCS_FD (-- PROGRAM ARGS... | REQUEST_FD)\n");
        finish(126);
    }
    long domain_fd = fd_arg(argv[1]), procs_fd = fd_arg(argv[2]), rc;
    if (domain_fd >= 0) {
        rc = sys3(SYS_landlock_restrict_self, domain_fd, 0, 0);
        if (rc < 0) fail("dsec: landlock", -rc);
        sys3(SYS_close, domain_fd, 0, 0);
    }
    if (procs_fd >= 0) {
        rc = sys3(SYS_write, procs_fd, (long)"0", 1);
        if (rc < 0) fail("dsec: joining the command's cgroup", -rc);
        sys3(SYS_close, procs_fd, 0, 0);
    }
    long oom = sys3(SYS_open, (long)"/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC, 0);
    if (oom >= 0) {
        rc = sys3(SYS_write, oom, (long)"1000", 4);
        if (rc < 0) fail("dsec: oom_score_adj", -rc);
        sys3(SYS_close, oom, 0, 0);
    } else if (oom != -ENOENT) { /* no /proc: no -1000 to raise either */
        fail("dsec: oom_score_adj", -oom);
    }
    if (direct) run(argv + 4, envp);
    long request_fd = fd_arg(argv[3]);
    if (request_fd < 0) fail("dsec: request descriptor", 9);
    serve(request_fd);
}

__asm__(".text\n.global _start\n_start:\n\tmov %rsp, %rdi\n\tand $-16, %rsp\n\tcall start\n\thlt\n");
