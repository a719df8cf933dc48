/* See sync_thread.h. */
#include "sync_thread.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

struct qf_sync_thread {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int event_fd;
    int stop;
    int busy;           /* a commit is handed over and not yet done */
    int64_t result;
    /* the commit handed over */
    int fd;
    qf_journal_batch batch;
    uint8_t *out;
    size_t size;
};

/* crc32, slicing by 8: eight tables of 256 entries, built once. */
static uint32_t crc_tables[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_tables[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_tables[t][i] = (crc_tables[t - 1][i] >> 8) ^ crc_tables[0][crc_tables[t - 1][i] & 0xFF];
}

uint32_t qf_crc32(uint32_t crc, const uint8_t *p, size_t len) {
    pthread_once(&crc_once, crc_init);
    crc = ~crc;
    while (len >= 8) {
        uint32_t lo = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        crc = crc_tables[7][lo & 0xFF] ^ crc_tables[6][(lo >> 8) & 0xFF] ^ crc_tables[5][(lo >> 16) & 0xFF]
            ^ crc_tables[4][lo >> 24] ^ crc_tables[3][p[4]] ^ crc_tables[2][p[5]] ^ crc_tables[1][p[6]]
            ^ crc_tables[0][p[7]];
        p += 8;
        len -= 8;
    }
    while (len--)
        crc = crc_tables[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

static void put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* Encode, checksum, append, sync: 0 or an errno, or the encoder's code. */
static int64_t commit(int fd, const qf_journal_batch *b, uint8_t *out, size_t size) {
    int64_t n = qf_journal_encode(b, out, size);
    if (n < 0)
        return n;
    if ((size_t)n != size || size > UINT32_MAX)
        return -4;
    uint8_t head[8];
    put_u32(head, (uint32_t)size);
    put_u32(head + 4, qf_crc32(0, out, size));
    struct iovec iov[2] = {{head, sizeof head}, {out, size}};
    int first = 0;
    while (first < 2) {
        ssize_t w = writev(fd, iov + first, 2 - first);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (w == 0)
            return EIO;
        while (first < 2 && (size_t)w >= iov[first].iov_len) {
            w -= (ssize_t)iov[first].iov_len;
            first++;
        }
        if (first < 2) {  /* a short write: the rest of this part next */
            iov[first].iov_base = (uint8_t *)iov[first].iov_base + w;
            iov[first].iov_len -= (size_t)w;
        }
    }
    while (fdatasync(fd) != 0) {
        if (errno != EINTR)
            return errno;
    }
    return 0;
}

static void *run(void *arg) {
    qf_sync_thread *t = arg;
    pthread_mutex_lock(&t->lock);
    for (;;) {
        while (!t->busy && !t->stop)
            pthread_cond_wait(&t->wake, &t->lock);
        if (!t->busy)
            break;
        int fd = t->fd;
        qf_journal_batch batch = t->batch;
        uint8_t *out = t->out;
        size_t size = t->size;
        pthread_mutex_unlock(&t->lock);
        int64_t result = commit(fd, &batch, out, size);
        pthread_mutex_lock(&t->lock);
        t->result = result;
        t->busy = 0;
        uint64_t one = 1;
        /* An eventfd's counter cannot overflow here: the loop reads it after each commit. */
        while (write(t->event_fd, &one, sizeof one) < 0 && errno == EINTR) {
        }
    }
    pthread_mutex_unlock(&t->lock);
    return NULL;
}

qf_sync_thread *qf_sync_start(int event_fd) {
    qf_sync_thread *t = calloc(1, sizeof *t);
    if (t == NULL)
        return NULL;
    t->event_fd = event_fd;
    pthread_mutex_init(&t->lock, NULL);
    pthread_cond_init(&t->wake, NULL);
    int err = pthread_create(&t->thread, NULL, run, t);
    if (err != 0) {
        pthread_cond_destroy(&t->wake);
        pthread_mutex_destroy(&t->lock);
        free(t);
        errno = err;
        return NULL;
    }
    return t;
}

int qf_sync_submit(qf_sync_thread *t, int fd, const qf_journal_batch *b, uint8_t *out, size_t size) {
    pthread_mutex_lock(&t->lock);
    if (t->busy || t->stop) {
        pthread_mutex_unlock(&t->lock);
        return -1;
    }
    t->fd = fd;
    t->batch = *b;
    t->out = out;
    t->size = size;
    t->result = 0;
    t->busy = 1;
    pthread_cond_signal(&t->wake);
    pthread_mutex_unlock(&t->lock);
    return 0;
}

int64_t qf_sync_result(qf_sync_thread *t) {
    pthread_mutex_lock(&t->lock);
    int64_t r = t->result;
    pthread_mutex_unlock(&t->lock);
    return r;
}

void qf_sync_stop(qf_sync_thread *t) {
    pthread_mutex_lock(&t->lock);
    t->stop = 1;
    pthread_cond_signal(&t->wake);
    pthread_mutex_unlock(&t->lock);
    pthread_join(t->thread, NULL);  /* it finishes the commit under way first */
    pthread_cond_destroy(&t->wake);
    pthread_mutex_destroy(&t->lock);
    free(t);
}
