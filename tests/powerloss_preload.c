/* LD_PRELOAD library for tests/powerloss.py: a log from which a test rebuilds what a
 * disk would hold after a power loss (every write not yet made durable is lost).
 *
 * For each write to a file under $CCSQ_POWERLOSS_ROOT it appends to $CCSQ_POWERLOSS_LOG,
 * before the write, the bytes the write overwrites and the file's size (record W);
 * after a successful fsync/fdatasync, that the file is durable (S); after a write
 * through an O_DSYNC/O_SYNC descriptor, that its range is durable (D); before an
 * ftruncate, the bytes it drops and the old size (T). Writes through mmap are not
 * seen (LMDB's lock.mdb and SQLite's -shm index, both rebuilt at open).
 * Build: cc -shared -fPIC -O2 -o powerloss.so powerloss_preload.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static ssize_t (*real_pwritev)(int, const struct iovec *, int, off_t);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_ftruncate)(int, off_t);

static int logfd = -1;
static char root[4096];
static size_t rootlen;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

__attribute__((constructor)) static void init(void) {
    real_write = dlsym(RTLD_NEXT, "write");
    real_pwrite = dlsym(RTLD_NEXT, "pwrite64");
    real_writev = dlsym(RTLD_NEXT, "writev");
    real_pwritev = dlsym(RTLD_NEXT, "pwritev64");
    real_fsync = dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = dlsym(RTLD_NEXT, "fdatasync");
    real_ftruncate = dlsym(RTLD_NEXT, "ftruncate64");
    const char *log = getenv("CCSQ_POWERLOSS_LOG"), *r = getenv("CCSQ_POWERLOSS_ROOT");
    if (!log || !r || strlen(r) >= sizeof root)
        return;
    strcpy(root, r);
    rootlen = strlen(root);
    logfd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
}

/* The path of fd if it is a file under root (into buf), else 0. */
static int watched(int fd, char *buf, size_t size) {
    if (logfd < 0 || fd == logfd)
        return 0;
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, buf, size - 1);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    return strncmp(buf, root, rootlen) == 0 && buf[rootlen] == '/';
}

static void put_record(char kind, const char *path, int64_t off, int64_t old_size, const char *data, int64_t n) {
    uint32_t plen = strlen(path);
    size_t total = 1 + 4 + plen + 24 + (size_t)n;
    char *rec = malloc(total), *q = rec;
    if (!rec)
        abort();
    *q++ = kind;
    memcpy(q, &plen, 4), q += 4;
    memcpy(q, path, plen), q += plen;
    memcpy(q, &off, 8), q += 8;
    memcpy(q, &old_size, 8), q += 8;
    memcpy(q, &n, 8), q += 8;
    if (n)
        memcpy(q, data, n);
    for (size_t done = 0; done < total;) { /* one O_APPEND write in practice */
        ssize_t w = real_write(logfd, rec + done, total - done);
        if (w <= 0)
            abort();
        done += w;
    }
    free(rec);
}

static int is_sync_fd(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl >= 0 && (fl & O_DSYNC);
}

/* Before a write of len bytes at off (-1: the fd's position / append): the pre-image. */
static void before_write(int fd, const char *path, off_t off, size_t len) {
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        return;
    if (off < 0) {
        int fl = fcntl(fd, F_GETFL);
        off = (fl >= 0 && (fl & O_APPEND)) ? st.st_size : lseek(fd, 0, SEEK_CUR);
    }
    int64_t n = 0;
    if (off < st.st_size)
        n = (int64_t)((size_t)(st.st_size - off) < len ? (size_t)(st.st_size - off) : len);
    char *old = n ? malloc(n) : NULL;
    if (n && (!old || pread(fd, old, n, off) != n))
        abort();
    put_record('W', path, off, st.st_size, old, n);
    free(old);
}

static ssize_t watched_write(int fd, off_t off, size_t len, ssize_t (*go)(void *), void *arg) {
    char path[4096];
    if (!watched(fd, path, sizeof path))
        return go(arg);
    pthread_mutex_lock(&mu);
    int durable = is_sync_fd(fd);
    off_t at = off >= 0 ? off : lseek(fd, 0, SEEK_CUR);
    if (!durable)
        before_write(fd, path, off, len);
    ssize_t r = go(arg);
    int saved = errno;
    if (durable && r > 0)
        put_record('D', path, at, r, NULL, 0); /* old size: the length written */
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}

struct wargs { int fd; const void *buf; size_t n; off_t off; const struct iovec *iov; int cnt; };
static ssize_t go_write(void *a) { struct wargs *w = a; return real_write(w->fd, w->buf, w->n); }
static ssize_t go_pwrite(void *a) { struct wargs *w = a; return real_pwrite(w->fd, w->buf, w->n, w->off); }
static ssize_t go_writev(void *a) { struct wargs *w = a; return real_writev(w->fd, w->iov, w->cnt); }
static ssize_t go_pwritev(void *a) { struct wargs *w = a; return real_pwritev(w->fd, w->iov, w->cnt, w->off); }

static size_t iov_len(const struct iovec *iov, int cnt) {
    size_t n = 0;
    for (int i = 0; i < cnt; i++)
        n += iov[i].iov_len;
    return n;
}

ssize_t write(int fd, const void *buf, size_t n) {
    struct wargs a = {fd, buf, n, -1, NULL, 0};
    return watched_write(fd, -1, n, go_write, &a);
}
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    struct wargs a = {fd, buf, n, off, NULL, 0};
    return watched_write(fd, off, n, go_pwrite, &a);
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) { return pwrite(fd, buf, n, off); }
ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    struct wargs a = {fd, NULL, 0, -1, iov, cnt};
    return watched_write(fd, -1, iov_len(iov, cnt), go_writev, &a);
}
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) {
    struct wargs a = {fd, NULL, 0, off, iov, cnt};
    return watched_write(fd, off, iov_len(iov, cnt), go_pwritev, &a);
}
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off_t off) { return pwritev(fd, iov, cnt, off); }

static int synced(int fd, int r) {
    char path[4096];
    int saved = errno;
    if (r == 0 && watched(fd, path, sizeof path)) {
        pthread_mutex_lock(&mu);
        put_record('S', path, 0, 0, NULL, 0);
        pthread_mutex_unlock(&mu);
    }
    errno = saved;
    return r;
}
int fsync(int fd) { return synced(fd, real_fsync(fd)); }
int fdatasync(int fd) { return synced(fd, real_fdatasync(fd)); }

int ftruncate(int fd, off_t length) {
    char path[4096];
    if (watched(fd, path, sizeof path)) {
        struct stat st;
        pthread_mutex_lock(&mu);
        if (fstat(fd, &st) == 0) {
            int64_t n = st.st_size > length ? st.st_size - length : 0;
            char *old = n ? malloc(n) : NULL;
            if (n && (!old || pread(fd, old, n, length) != n))
                abort();
            put_record('T', path, length, st.st_size, old, n);
            free(old);
        }
        int r = real_ftruncate(fd, length), saved = errno;
        pthread_mutex_unlock(&mu);
        errno = saved;
        return r;
    }
    return real_ftruncate(fd, length);
}
int ftruncate64(int fd, off_t length) { return ftruncate(fd, length); }
