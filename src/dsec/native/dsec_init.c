/*
 * dsec_init: PID 1 of a dsec container.
 *
 * It holds the container's namespaces open, reaps every zombie that is
 * reparented to it, and does nothing else: no files, no sockets, no secrets.
 * All signals are blocked and consumed with sigwaitinfo(); none of them ends
 * it, so a process inside the sandbox cannot stop the sandbox with `kill 1`
 * (only SIGKILL from the host's pid namespace does). Built with `cc -O2 -static`.
 *
 * `dsec_init --probe` exits 0 at once (used by node setup to check that the
 * OCI runtime can start a container at all).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--probe") == 0)
        return 0;
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);
    /* Nothing of the edge may leak in: keep no file descriptor at all. */
    for (int fd = 0; fd < 3; fd++) close(fd);
    prctl(PR_SET_NAME, "dsec-init", 0, 0, 0);
    for (;;) {
        siginfo_t info;
        int sig = sigwaitinfo(&all, &info);
        if (sig < 0) {
            if (errno == EINTR) continue;
            _exit(1);
        }
        /* Reap every child that has exited (SIGCHLD is coalesced). */
        while (waitpid(-1, NULL, WNOHANG) > 0) {}
    }
}
