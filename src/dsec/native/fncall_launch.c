/*
 * fncall_launch: build the read-only root of one fncall pool in a private mount
 * namespace and exec the pool's zygote inside it.
 *
 *   fncall_launch [--spawn HELPER] SCRATCH_DIR TMPFS_MB LAYER_BOTTOM [LAYER ...] -- PROG ARGS...
 *
 * Each LAYER is an EROFS image file or a block device (/dev/loopN) holding one. HELPER (the
 * static fncall_spawn every command of a worker execs through) is bound read-only at
 * /dev/.dsec-spawn.
 *
 * Steps (all mounts live only in the new mount namespace, so they vanish when
 * the zygote and its workers exit; nothing can leak into the host namespace):
 *   1. unshare(CLONE_NEWNS), make every mount private;
 *   2. tmpfs on SCRATCH_DIR (TMPFS_MB MiB) holding the overlay upper/work dirs;
 *   3. each EROFS layer mounted (read-only, nosuid, nodev) from its file, or from the
 *      loop device the caller bound to it and holds until the zygote is up (kernels
 *      before 6.12, files on tmpfs/overlayfs, DSEC_EROFS_MOUNT=loop: see
 *      dsec.privileged.mount.erofs_mount_sources; AUTOCLEAR frees it with this namespace);
 *   4. overlay (lowers top first) on SCRATCH_DIR/root, its directories named relative to
 *      SCRATCH_DIR (the kernel shows the option strings in every mountinfo: the workers'
 *      /proc/mounts would show the node's DSEC_HOME otherwise); mount points that the
 *      workers need (/work /tmp /proc /dev /dev/shm) are created in the upper;
 *   5. a minimal /dev (tmpfs with bind-mounted null zero full random urandom, and HELPER);
 *   6. pivot_root into the overlay, detach the old root, remount / read-only.
 *
 * Exit codes: 0 never (exec), 64 usage, 70 setup failure (message on stderr).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_LAYERS 64

static void die(const char *what, const char *arg) {
    fprintf(stderr, "fncall_launch: %s %s: %s\n", what, arg ? arg : "", strerror(errno));
    exit(70);
}

static void mkdir_p(const char *path, mode_t mode) {
    char buf[4096];
    size_t n = strlen(path);
    if (n >= sizeof buf) { errno = ENAMETOOLONG; die("mkdir", path); }
    memcpy(buf, path, n + 1);
    for (char *p = buf + 1; *p; p++) {
        if (*p == '/') {
            *p = 0;
            if (mkdir(buf, mode) != 0 && errno != EEXIST) die("mkdir", buf);
            *p = '/';
        }
    }
    if (mkdir(buf, mode) != 0 && errno != EEXIST) die("mkdir", buf);
}

static void touch(const char *path) {
    int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) die("create", path);
    close(fd);
}

int main(int argc, char **argv) {
    const char *spawn = NULL;
    if (argc > 2 && strcmp(argv[1], "--spawn") == 0) {
        spawn = argv[2];
        argv += 2;
        argc -= 2;
    }
    if (argc < 6) {
        fprintf(stderr, "usage: fncall_launch [--spawn HELPER] SCRATCH TMPFS_MB LAYER... -- PROG ARGS\n");
        return 64;
    }
    const char *scratch = argv[1];
    long tmpfs_mb = strtol(argv[2], NULL, 10);
    const char *layers[MAX_LAYERS];
    int nlayers = 0, i = 3;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (nlayers == MAX_LAYERS) { fprintf(stderr, "fncall_launch: too many layers\n"); return 64; }
        layers[nlayers++] = argv[i];
    }
    if (i >= argc - 1 || nlayers == 0 || tmpfs_mb <= 0) { fprintf(stderr, "fncall_launch: bad arguments\n"); return 64; }
    char **prog = &argv[i + 1];

    if (unshare(CLONE_NEWNS) != 0) die("unshare", "CLONE_NEWNS");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) die("make-rprivate", "/");

    char opts[256], path[4096], lower[MAX_LAYERS * 4200 / 8];
    snprintf(opts, sizeof opts, "size=%ldm,mode=0700", tmpfs_mb);
    if (mount("dsec-fncall", scratch, "tmpfs", MS_NOSUID | MS_NODEV, opts) != 0) die("mount tmpfs", scratch);

    lower[0] = 0;
    for (int l = nlayers - 1; l >= 0; l--) {  /* overlay wants the top layer first */
        snprintf(path, sizeof path, "%s/l%d", scratch, l);
        mkdir_p(path, 0755);
        if (mount(layers[l], path, "erofs", MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) != 0) die("mount erofs", layers[l]);
        char name[16];
        snprintf(name, sizeof name, "l%d", l);
        if (strlen(lower) + strlen(name) + 2 >= sizeof lower) { errno = E2BIG; die("lowerdir", path); }
        if (lower[0]) strcat(lower, ":");
        strcat(lower, name);
    }
    char upper[4200], work[4200], root[4200], ovl[sizeof lower + 8500];
    snprintf(upper, sizeof upper, "%s/upper", scratch);
    snprintf(work, sizeof work, "%s/work", scratch);
    snprintf(root, sizeof root, "%s/root", scratch);
    mkdir_p(upper, 0755);
    mkdir_p(work, 0755);
    mkdir_p(root, 0755);
    if (chdir(scratch) != 0) die("chdir", scratch);  /* the overlay's names are relative to it */
    snprintf(ovl, sizeof ovl, "lowerdir=%s,upperdir=upper,workdir=work", lower);
    if (mount("overlay", root, "overlay", MS_NOSUID | MS_NODEV, ovl) != 0) die("mount overlay", root);

    static const char *dirs[] = {"work", "tmp", "proc", "dev", "run", NULL};
    for (int d = 0; dirs[d]; d++) {
        snprintf(path, sizeof path, "%s/%s", root, dirs[d]);
        mkdir_p(path, 0755);
    }
    snprintf(path, sizeof path, "%s/tmp", root);
    chmod(path, 01777);

    snprintf(path, sizeof path, "%s/dev", root);
    if (mount("dsec-dev", path, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755") != 0) die("mount /dev", path);
    static const char *nodes[] = {"null", "zero", "full", "random", "urandom", NULL};
    for (int d = 0; nodes[d]; d++) {
        char src[64];
        snprintf(src, sizeof src, "/dev/%s", nodes[d]);
        snprintf(path, sizeof path, "%s/dev/%s", root, nodes[d]);
        touch(path);
        if (mount(src, path, NULL, MS_BIND, NULL) != 0) die("bind", src);
        if (mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC, NULL) != 0) die("remount", path);
    }
    if (spawn) { /* read-only, and executable: /dev itself is noexec */
        snprintf(path, sizeof path, "%s/dev/.dsec-spawn", root);
        touch(path);
        if (mount(spawn, path, NULL, MS_BIND, NULL) != 0) die("bind", spawn);
        if (mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) != 0)
            die("remount", path);
    }
    snprintf(path, sizeof path, "%s/dev/shm", root);
    mkdir_p(path, 01777);
    static const char *links[][2] = {{"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"},
                                     {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"}, {NULL, NULL}};
    for (int d = 0; links[d][0]; d++) {
        snprintf(path, sizeof path, "%s/dev/%s", root, links[d][1]);
        if (symlink(links[d][0], path) != 0) die("symlink", path);
    }
    snprintf(path, sizeof path, "%s/dev", root);
    if (mount(NULL, path, NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755") != 0)
        die("remount ro", path);

    if (chdir(root) != 0) die("chdir", root);
    if (syscall(SYS_pivot_root, ".", ".") != 0) die("pivot_root", root);
    if (umount2(".", MNT_DETACH) != 0) die("detach old root", "");
    if (chdir("/") != 0) die("chdir", "/");
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) != 0)
        die("remount ro", "/");

    execv(prog[0], prog);
    if (errno == ENOENT || errno == ENOTDIR) {
        /* the image has no such program: the caller's choice of image, not a failure */
        fprintf(stderr, "fncall_launch: exec %s: %s\n", prog[0], strerror(errno));
        exit(127);
    }
    die("exec", prog[0]);
    return 70;
}
