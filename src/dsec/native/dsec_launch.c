/*
 * dsec_launch: run the OCI runtime in the node's launch mount namespace, with the one
 * sandbox root it needs attached there.
 *
 *   dsec_launch NSFILE TREEFD MOUNTPOINT -- OCI-RUNTIME ARGS...
 *
 * NSFILE is the pinned launch namespace (a mount namespace holding the host's mounts and
 * none of the sandboxes'), TREEFD an inherited descriptor of a detached copy of the
 * sandbox's root mount (open_tree(OPEN_TREE_CLONE)), MOUNTPOINT where it goes (the same
 * path as in the node's namespace, so the bundle's root.path is unchanged).
 *
 * Why: an OCI runtime makes a container's mount namespace by copying the one it runs in,
 * then reads its mountinfo and unmounts the old root: each O(mounts). From the node's own
 * namespace, which holds an overlay and an upper tmpfs for every live sandbox, a creation
 * cost grew with the live count (crun run 16 ms at 0 live, 315 ms at 3,000). From the
 * launch namespace it copies the host's few dozen mounts and this sandbox's root.
 *
 * It joins the namespace (a single-threaded process may), attaches the tree, runs the
 * runtime as its child, waits for it, detaches the tree from the launch namespace (the
 * container's namespace has its own copy by then) and exits with the runtime's status
 * (128 + N when killed by signal N). SIGTERM or SIGINT is passed on to the runtime as
 * SIGKILL, and the tree is still detached before exiting; the runtime dies with it
 * (PR_SET_PDEATHSIG) if it is killed outright.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif

static volatile pid_t child = 0;

static void forward(int sig) {
    (void)sig;
    if (child > 0)
        kill(child, SIGKILL);
}

static int fail(const char *what) {
    fprintf(stderr, "dsec_launch: %s: %s\n", what, strerror(errno));
    return 125;
}

int main(int argc, char **argv) {
    if (argc < 6 || strcmp(argv[4], "--") != 0) {
        fprintf(stderr, "usage: dsec_launch NSFILE TREEFD MOUNTPOINT -- RUNTIME ARGS...\n");
        return 125;
    }
    const char *nsfile = argv[1];
    int tree = atoi(argv[2]);
    const char *target = argv[3];

    int ns = open(nsfile, O_RDONLY | O_CLOEXEC);
    if (ns < 0)
        return fail("open the launch namespace");
    if (setns(ns, CLONE_NEWNS) < 0)
        return fail("setns(launch namespace)");
    close(ns);
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        return fail("move_mount(sandbox root)");
    close(tree);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = forward;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    pid_t parent = getpid();
    child = fork();
    if (child < 0) {
        int rc = fail("fork");
        umount2(target, MNT_DETACH);
        return rc;
    }
    if (child == 0) {
        signal(SIGTERM, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(125);
        execvp(argv[5], &argv[5]);
        fprintf(stderr, "dsec_launch: exec %s: %s\n", argv[5], strerror(errno));
        _exit(127);
    }
    int status = 0;
    while (waitpid(child, &status, 0) < 0) {
        if (errno != EINTR) {
            status = 125 << 8;
            break;
        }
    }
    if (umount2(target, MNT_DETACH) < 0 && errno != EINVAL)
        fprintf(stderr, "dsec_launch: detach %s: %s\n", target, strerror(errno));
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return WEXITSTATUS(status);
}
