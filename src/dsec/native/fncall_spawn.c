/*
 * fncall_spawn: what every command of a fncall worker runs through between the agent's vfork
 * and the command itself. The agent is Python: a hook run after its fork (preexec_fn) makes it
 * fork instead of vfork, which copies its address space (~2-4 ms per command on this kind of
 * VM); this helper is one exec of a few kilobytes (~0.1 ms).
 *
 *   /dev/.dsec-spawn DOMAIN_FD -- PROGRAM ARGS...     (fncall_launch binds it there)
 *
 * In order, a step that fails ends the command with exit status 126 and a message on stderr:
 *   1. DOMAIN_FD >= 0: landlock_restrict_self() with that ruleset, then closed: the command is
 *      a Landlock domain of its own, so no process of another command can open its
 *      /proc/<pid>/mem (the agent has set no_new_privs; docs/design/tenancy.md);
 *   2. PROGRAM executed as execvp() does: searched in the PATH of the environment (the
 *      command's own), a file without #! run by /bin/sh; 127 if it does not exist, else 126,
 *      with "PROGRAM: reason" on stderr.
 * Nothing else of the process changes.
 *
 * Freestanding (x86-64, no libc: built with -nostdlib -static): a static glibc binary costs
 * ~0.7 ms more per exec here, a third of a command's round trip.
 */
typedef unsigned long size_t;

#define SYS_write 1
#define SYS_close 3
#define SYS_execve 59
#define SYS_exit_group 231
#define SYS_landlock_restrict_self 446
#define ENOENT 2
#define ENOEXEC 8
#define EACCES 13
#define ENOTDIR 20
#define PATH_MAX 4096

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

static void __attribute__((noreturn, used)) start(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1), **envp = argv + argc + 1;
    if (argc < 4 || argv[2][0] != '-' || argv[2][1] != '-' || argv[2][2]) {
        say("usage: fncall_spawn DOMAIN_FD -- PROGRAM ARGS...\n");
        finish(126);
    }
    long domain_fd = -1;
    if (argv[1][0] != '-') {
        domain_fd = 0;
        for (const char *p = argv[1]; *p >= '0' && *p <= '9'; p++) domain_fd = domain_fd * 10 + (*p - '0');
    }
    if (domain_fd >= 0) {
        long rc = sys3(SYS_landlock_restrict_self, domain_fd, 0, 0);
        if (rc < 0) fail("dsec: landlock", -rc);
        sys3(SYS_close, domain_fd, 0, 0);
    }
    char **cmd = argv + 3;
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

__asm__(".text\n.global _start\n_start:\n\tmov %rsp, %rdi\n\tand $-16, %rsp\n\tcall start\n\thlt\n");
