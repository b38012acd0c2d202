/* The emulated cluster's NFQUEUE delay daemon, compiled (hipress/bench/cluster.py builds it on
 * first use and falls back to its Python twin, cluster.py's _delay_daemon, without a C compiler).
 *
 *     delay_daemon --delay-daemon <queue number> <delay in seconds>
 *
 * Runs inside one rank's network namespace, bound to the NFQUEUE queue that the iptables rule
 * feeds with every packet arriving at the rank: it receives each packet's metadata (not its
 * payload) and accepts it `delay` seconds after reading it, one batch verdict for everything
 * due (packet ids are sequential). Prints "ready" once bound; SIGTERM/SIGINT accept what is
 * still held and exit.
 *
 * Why C: the daemons play the wire, yet they share the ranks' CPUs. The Python daemon cost about
 * 46 us of CPU per packet (VGG19-like at 1 Gbit/s: 10% of a core per rank, a fifth of the 2-core
 * machine that the ranks then lacked). Here a packet costs the kernel's netlink work and a share
 * of one recvmmsg call.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netlink.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef NETLINK_NETFILTER
#define NETLINK_NETFILTER 12
#endif
#ifndef SO_RCVBUFFORCE
#define SO_RCVBUFFORCE 33
#endif
#ifndef NETLINK_NO_ENOBUFS
#define NETLINK_NO_ENOBUFS 5
#endif

/* nfnetlink_queue's numbers (linux/netfilter/nfnetlink_queue.h), spelled out so that the
 * daemon builds without the kernel's netfilter headers. */
enum { SUBSYS_QUEUE = 3, MSG_PACKET = 0, MSG_CONFIG = 2, MSG_VERDICT_BATCH = 3 };
enum { CFG_CMD = 1, CFG_PARAMS = 2, CFG_QUEUE_MAXLEN = 3, CFG_MASK = 4, CFG_FLAGS = 5 };
enum { ATTR_PACKET_HDR = 1, ATTR_VERDICT_HDR = 2 };
enum { CMD_BIND = 1, COPY_META = 1, NF_ACCEPT_VERDICT = 1 };
enum { F_FAIL_OPEN = 1, F_GSO = 4 }; /* accept when the queue is full; keep GSO packets whole */
#define QUEUE_MAXLEN (1u << 17)

static volatile sig_atomic_t stopping = 0;
static void on_signal(int sig) { (void)sig; stopping = 1; }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static void wait_s(int fd, double seconds) { /* ppoll: a timeout in ns, where poll's is in ms */
    struct pollfd p = {fd, POLLIN, 0};
    struct timespec t = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    ppoll(&p, fd >= 0 ? 1 : 0, &t, NULL);
}

/* A netfilter message: nlmsghdr, nfgenmsg (family, version, queue number), attributes. */
struct msg {
    size_t len;
    unsigned char buf[256];
};

static void msg_start(struct msg *m, int type, uint16_t qnum, uint16_t flags, uint32_t seq) {
    memset(m, 0, sizeof *m);
    struct nlmsghdr *h = (struct nlmsghdr *)m->buf;
    h->nlmsg_type = (uint16_t)((SUBSYS_QUEUE << 8) | type);
    h->nlmsg_flags = flags;
    h->nlmsg_seq = seq;
    m->buf[16] = AF_UNSPEC;                 /* nfgenmsg: family, version 0, */
    uint16_t res = htons(qnum);             /* res_id = queue number (big-endian) */
    memcpy(m->buf + 18, &res, 2);
    m->len = 20;
}

static void msg_attr(struct msg *m, uint16_t type, const void *payload, uint16_t n) {
    uint16_t alen = (uint16_t)(4 + n);
    memcpy(m->buf + m->len, &alen, 2);
    memcpy(m->buf + m->len + 2, &type, 2);
    memcpy(m->buf + m->len + 4, payload, n);
    m->len += (size_t)((alen + 3) & ~3);
}

static int msg_send(int fd, struct msg *m) {
    ((struct nlmsghdr *)m->buf)->nlmsg_len = (uint32_t)m->len;
    return send(fd, m->buf, m->len, 0) == (ssize_t)m->len ? 0 : -1;
}

static int configure(int fd, uint16_t qnum) {
    unsigned char cmd[4] = {CMD_BIND, 0, 0, AF_INET};                 /* command, pad, be16 pf */
    unsigned char params[5] = {0, 0, 0, 0, COPY_META};                /* be32 copy range, mode */
    uint32_t maxlen = htonl(QUEUE_MAXLEN), flags = htonl(F_FAIL_OPEN | F_GSO);
    for (uint32_t step = 1; step <= 4; step++) {
        struct msg m;
        msg_start(&m, MSG_CONFIG, qnum, NLM_F_REQUEST | NLM_F_ACK, step);
        if (step == 1) msg_attr(&m, CFG_CMD, cmd, sizeof cmd);
        if (step == 2) msg_attr(&m, CFG_PARAMS, params, sizeof params);
        if (step == 3) msg_attr(&m, CFG_QUEUE_MAXLEN, &maxlen, 4);
        if (step == 4) {
            msg_attr(&m, CFG_FLAGS, &flags, 4);
            msg_attr(&m, CFG_MASK, &flags, 4);
        }
        unsigned char ack[512];
        if (msg_send(fd, &m) < 0 || recv(fd, ack, sizeof ack, 0) < 20) {
            fprintf(stderr, "nfqueue config step %u: %s\n", step - 1, strerror(errno));
            return -1;
        }
        const struct nlmsghdr *h = (const struct nlmsghdr *)ack;
        int err;
        memcpy(&err, ack + 16, 4);
        if (h->nlmsg_type == NLMSG_ERROR && err) {
            fprintf(stderr, "nfqueue config step %u: %s\n", step - 1, strerror(-err));
            return -1;
        }
    }
    return 0;
}

static void accept_upto(int fd, uint16_t qnum, uint32_t id) {
    struct msg m;
    uint32_t hdr[2] = {htonl(NF_ACCEPT_VERDICT), htonl(id)};
    msg_start(&m, MSG_VERDICT_BATCH, qnum, NLM_F_REQUEST, 0);
    msg_attr(&m, ATTR_VERDICT_HDR, hdr, sizeof hdr);
    msg_send(fd, &m);
}

/* Held packets, oldest first: a ring of (due time, id), as many as the queue can hold. */
#define HELD (QUEUE_MAXLEN + 1024)
static double held_due[HELD];
static uint32_t held_id[HELD];
static size_t head = 0, count = 0;

static void hold(double due, uint32_t id) {
    if (count == HELD) { /* cannot happen with the queue's own limit; keep the newest */
        head = (head + 1) % HELD;
        count--;
    }
    size_t at = (head + count) % HELD;
    held_due[at] = due;
    held_id[at] = id;
    count++;
}

/* Reads every queued packet's id (whatever arrived since the last read), all due at `due`. */
#define BATCH 64
#define MSG_BYTES 4096
static unsigned char rbuf[BATCH][MSG_BYTES];

static void read_packets(int fd, double due) {
    struct mmsghdr mm[BATCH];
    struct iovec iov[BATCH];
    for (;;) {
        for (int i = 0; i < BATCH; i++) {
            iov[i].iov_base = rbuf[i];
            iov[i].iov_len = MSG_BYTES;
            memset(&mm[i].msg_hdr, 0, sizeof mm[i].msg_hdr);
            mm[i].msg_hdr.msg_iov = &iov[i];
            mm[i].msg_hdr.msg_iovlen = 1;
        }
        int got = recvmmsg(fd, mm, BATCH, MSG_DONTWAIT, NULL);
        if (got <= 0) return;
        for (int i = 0; i < got; i++) {
            const unsigned char *b = rbuf[i];
            size_t n = mm[i].msg_len, off = 0;
            while (off + 16 <= n) {
                uint32_t len;
                uint16_t type;
                memcpy(&len, b + off, 4);
                memcpy(&type, b + off + 4, 2);
                if (len < 16 || off + len > n) break;
                if (type == ((SUBSYS_QUEUE << 8) | MSG_PACKET)) {
                    for (size_t a = off + 20; a + 4 <= off + len;) {
                        uint16_t alen, atype;
                        memcpy(&alen, b + a, 2);
                        memcpy(&atype, b + a + 2, 2);
                        if ((atype & 0x7FFF) == ATTR_PACKET_HDR && alen >= 8) { /* be32 id, be16 proto, u8 hook */
                            uint32_t id;
                            memcpy(&id, b + a + 4, 4);
                            hold(due, ntohl(id));
                            break;
                        }
                        if (alen < 4) break;
                        a += (size_t)((alen + 3) & ~3);
                    }
                }
                off += (size_t)((len + 3) & ~3);
            }
        }
        if (got < BATCH) return;
    }
}

int main(int argc, char **argv) {
    if (argc != 4 || strcmp(argv[1], "--delay-daemon") != 0) {
        fprintf(stderr, "usage: %s --delay-daemon <queue number> <delay in seconds>\n", argv[0]);
        return 2;
    }
    uint16_t qnum = (uint16_t)atoi(argv[2]);
    double delay = atof(argv[3]);
    setpriority(PRIO_PROCESS, 0, -10);   /* it plays the part of the wire: keep its timing tight */
    prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0); /* the default 50 us of slack would add to every delay */

    int fd = socket(AF_NETLINK, SOCK_RAW, NETLINK_NETFILTER);
    if (fd < 0) {
        fprintf(stderr, "netlink socket: %s\n", strerror(errno));
        return 1;
    }
    int big = 32 << 20, one = 1;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
    /* a lost notice is covered by the next batch verdict, which accepts every id up to its own */
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sockaddr_nl self = {.nl_family = AF_NETLINK};
    if (bind(fd, (struct sockaddr *)&self, sizeof self) < 0) {
        fprintf(stderr, "netlink bind: %s\n", strerror(errno));
        return 1;
    }
    if (configure(fd, qnum) < 0) return 1;

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal; /* no SA_RESTART: ppoll returns EINTR and the loop sees the flag */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    /* A timed wait returns late by a roughly fixed amount (the timer's exit and wake-up, tens of
     * us on a VM, against 0.2 ms delays): aim that much early so packets leave on time. */
    double late[31];
    for (int i = 0; i < 31; i++) {
        double t0 = now_s();
        wait_s(-1, 1e-4);
        late[i] = now_s() - t0 - 1e-4;
    }
    for (int i = 1; i < 31; i++) /* insertion sort, for the median */
        for (int j = i; j > 0 && late[j] < late[j - 1]; j--) {
            double t = late[j];
            late[j] = late[j - 1];
            late[j - 1] = t;
        }
    double early = late[15] < delay / 4 ? late[15] : delay / 4;
    if (early < 0) early = 0;

    printf("ready\n");
    fflush(stdout);
    while (!stopping) {
        double timeout = 0.2;
        if (count) {
            timeout = held_due[head] - early - now_s();
            if (timeout < 0) timeout = 0;
        }
        struct pollfd p = {fd, POLLIN, 0};
        struct timespec t = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
        int ready = ppoll(&p, 1, &t, NULL);
        if (ready < 0 && errno == EINTR) continue;
        if (ready > 0) read_packets(fd, now_s() + delay);
        double now = now_s() + early;
        int any = 0;
        uint32_t last = 0;
        while (count && held_due[head] <= now) {
            last = held_id[head];
            head = (head + 1) % HELD;
            count--;
            any = 1;
        }
        if (any) accept_upto(fd, qnum, last);
    }
    if (count) accept_upto(fd, qnum, held_id[(head + count - 1) % HELD]);
    return 0;
}
