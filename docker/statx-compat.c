/* Preloaded into every process of the tool image (/etc/ld.so.preload).
 *
 * gVisor as Debian bookworm ships it (runsc 20221219) refuses statx() with AT_NO_AUTOMOUNT (EINVAL),
 * and coreutils' ls and stat always pass that flag, so `ls -l` and `stat` fail in a runsc sandbox.
 * The flag only keeps an automount point from being triggered, and gVisor has none: retrying without
 * it answers the same question. Under runc the first call succeeds and nothing else happens.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
    long rc = syscall(SYS_statx, dirfd, path, flags, mask, buf);
    if (rc == -1 && errno == EINVAL && (flags & AT_NO_AUTOMOUNT))
        rc = syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
    return (int)rc;
}
