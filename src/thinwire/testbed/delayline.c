/* thinwire delay line: holds each host's frames for a set delay, in order, with
 * optional jitter and random loss. One process serves every host of a cluster; it runs
 * in the cluster's bridge namespace. The design, the semantics and the tuning advice
 * are in delayline.py beside this file; this is only the mechanism.
 *
 * Per host link (argument "DEV,TAP,DELAY_NS,JITTER_NS,LOSS,BUFFER_BYTES,TSO"):
 *   DEV  the bridge-side end of the host's veth, NOT a bridge port: read and written
 *        with an AF_PACKET socket (PACKET_VNET_HDR, so GSO super-packets and partial
 *        checksums pass through whole, with no copy of the segmentation work);
 *   TAP  a TAP device this program creates (IFF_VNET_HDR); the caller enslaves it to
 *        the bridge once this program prints "ready".
 * host -> bridge: DEV rx -> queue -> TAP write;  bridge -> host: TAP read -> queue ->
 * DEV tx. Each queue is a byte ring of BUFFER_BYTES holding frames with their due time;
 * a frame's due time is never before its predecessor's, so the ring is a FIFO and a
 * frame never overtakes another (jitter without reordering).
 *
 * Exits when any of its interfaces vanishes (EPOLLERR/EPOLLHUP: a namespace deleted),
 * on SIGTERM/SIGINT, and prints per-link counters as JSON lines to stderr on exit and
 * on SIGUSR1.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if_ether.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <netpacket/packet.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23
#endif

#define MAX_LINKS 64
#define MAX_FRAME (65536 + 4096) /* vnet header + the largest GSO super-packet */
#define BATCH 64               /* frames read from one fd per wake-up (fairness) */
#define RETRY_NS 100000ull     /* resend after EAGAIN this much later */
#define MAX_SLACK_NS 200000    /* never send a frame more than this early */

struct rec {
  uint64_t due;
  uint32_t len;
  uint32_t skip; /* 1: padding up to the end of the ring, wrap to 0 */
};

struct queue {
  uint8_t *buf;
  size_t cap, head, tail, used;
  uint64_t last_due, delay_ns, jitter_ns;
  double loss;
  int in_fd, out_fd;
  unsigned long long in, out, lost, overflow, errors, bytes, retries;
};

struct link {
  char dev[IFNAMSIZ], tap[IFNAMSIZ];
  int pfd, tfd;
  struct queue up, down; /* up: host -> bridge, down: bridge -> host */
};

static struct link links[MAX_LINKS];
static int nlinks;
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint8_t scratch[MAX_FRAME];

static void die(const char *what, const char *name) {
  fprintf(stderr, "thinwire-delayline: %s %s: %s\n", what, name ? name : "", strerror(errno));
  exit(1);
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static double uniform01(void) { /* xorshift64*: fast, good enough for loss and jitter */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 0x2545f4914f6cdd1dull) >> 11) * 0x1.0p-53;
}

/* The record at the head, skipping wrap padding; NULL when empty. */
static struct rec *q_front(struct queue *q) {
  if (q->used == 0) return NULL;
  if (q->cap - q->head < sizeof(struct rec) || ((struct rec *)(q->buf + q->head))->skip) {
    q->used -= q->cap - q->head;
    q->head = 0;
  }
  return (struct rec *)(q->buf + q->head);
}

static void q_pop(struct queue *q, struct rec *r) {
  size_t need = (sizeof(struct rec) + r->len + 7) & ~(size_t)7;
  q->head += need;
  q->used -= need;
  if (q->used == 0) q->head = q->tail = 0;
}

/* Room for a frame of up to len bytes at the tail (wrapping if need be), or NULL. The
 * frame is read straight into it (one copy fewer) and kept by q_commit. */
static struct rec *q_reserve(struct queue *q, uint32_t len) {
  size_t need = (sizeof(struct rec) + len + 7) & ~(size_t)7;
  if (q->used == 0) q->head = q->tail = 0;
  if (q->used + need > q->cap) return NULL;
  if (q->tail >= q->head) {
    if (q->cap - q->tail < need) { /* wrap: pad to the end, write at 0 */
      if (q->head < need) return NULL;
      if (q->cap - q->tail >= sizeof(struct rec)) ((struct rec *)(q->buf + q->tail))->skip = 1;
      q->used += q->cap - q->tail;
      q->tail = 0;
    }
  } else if (q->head - q->tail < need) {
    return NULL;
  }
  return (struct rec *)(q->buf + q->tail);
}

static void q_commit(struct queue *q, struct rec *r, uint32_t len, uint64_t due) {
  size_t need = (sizeof(struct rec) + len + 7) & ~(size_t)7;
  r->due = due;
  r->len = len;
  r->skip = 0;
  q->tail += need;
  q->used += need;
}

/* Keep a frame just read into r (NULL: it went to scratch, the ring being full). */
static void enqueue(struct queue *q, struct rec *r, uint32_t len, uint64_t t) {
  q->in++;
  if (r == NULL) {
    q->overflow++;
    return;
  }
  if (q->loss > 0 && uniform01() < q->loss) {
    q->lost++;
    return;
  }
  uint64_t d = q->delay_ns;
  if (q->jitter_ns) {
    double j = (2.0 * uniform01() - 1.0) * (double)q->jitter_ns;
    d = (double)d + j < 0 ? 0 : (uint64_t)((double)d + j);
  }
  uint64_t due = t + d;
  if (due < q->last_due) due = q->last_due; /* never overtake the frame before */
  q_commit(q, r, len, due);
  q->last_due = due;
}

/* Send every frame whose time has come; return the earliest due time left (or 0). */
static uint64_t flush(struct queue *q, uint64_t t) {
  struct rec *r;
  while ((r = q_front(q)) != NULL) {
    if (r->due > t) return r->due;
    ssize_t n = write(q->out_fd, r + 1, r->len);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      q->retries++;
      return t + RETRY_NS;
    }
    if (n < 0) q->errors++; /* e.g. ENOBUFS: the qdisc behind dropped it, as a link would */
    else {
      q->out++;
      q->bytes += r->len;
    }
    q_pop(q, r);
  }
  return 0;
}

/* When the kernel received a frame from the host (SO_TIMESTAMPNS, real-time clock) on
 * our monotonic clock: the delay counts from the frame's arrival, not from our wake-up
 * (tens of microseconds later when we were idle). 0 when there is no stamp. */
static uint64_t arrival_ns(struct msghdr *msg) {
  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
      struct timespec stamp, rt, mono;
      memcpy(&stamp, CMSG_DATA(c), sizeof stamp);
      clock_gettime(CLOCK_REALTIME, &rt);
      clock_gettime(CLOCK_MONOTONIC, &mono);
      int64_t age = ((int64_t)rt.tv_sec - stamp.tv_sec) * 1000000000ll + (rt.tv_nsec - stamp.tv_nsec);
      uint64_t m = (uint64_t)mono.tv_sec * 1000000000ull + (uint64_t)mono.tv_nsec;
      /* Trust only a plausible age: a clock step must not shift delays. */
      return age >= 0 && age < 10000000 ? m - (uint64_t)age : m;
    }
  }
  return 0;
}

static void drain(struct queue *q, int is_packet) {
  for (int i = 0; i < BATCH; i++) {
    struct rec *r = q_reserve(q, MAX_FRAME);
    uint8_t *dst = r ? (uint8_t *)(r + 1) : scratch;
    uint64_t t = 0;
    ssize_t n;
    if (is_packet) {
      char control[128];
      struct iovec iov = {.iov_base = dst, .iov_len = MAX_FRAME};
      struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                           .msg_controllen = sizeof control};
      n = recvmsg(q->in_fd, &msg, MSG_TRUNC);
      if (n >= 0) t = arrival_ns(&msg);
    } else {
      n = read(q->in_fd, dst, MAX_FRAME);
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      if (errno == ENETDOWN || errno == ENXIO || errno == EBADFD) {
        fprintf(stderr, "thinwire-delayline: an interface is gone, exiting\n");
        exit(0);
      }
      q->errors++;
      return;
    }
    if ((size_t)n > MAX_FRAME) { /* larger than any GSO packet we expect */
      q->in++;
      q->overflow++;
      continue;
    }
    enqueue(q, r, (uint32_t)n, t ? t : now_ns());
  }
}

static void print_stats(void) {
  for (int i = 0; i < nlinks; i++) {
    struct queue *qs[2] = {&links[i].up, &links[i].down};
    for (int k = 0; k < 2; k++) {
      struct queue *q = qs[k];
      fprintf(stderr,
              "{\"dev\": \"%s\", \"dir\": \"%s\", \"in\": %llu, \"out\": %llu, \"lost\": %llu, "
              "\"overflow\": %llu, \"errors\": %llu, \"bytes\": %llu, \"retries\": %llu}\n",
              links[i].dev, k ? "down" : "up", q->in, q->out, q->lost, q->overflow, q->errors,
              q->bytes, q->retries);
    }
  }
  fflush(stderr);
}

static int open_packet(const char *dev) {
  int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL));
  if (fd < 0) die("socket(AF_PACKET) for", dev);
  int one = 1, big = 8 << 20;
  if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0)
    die("PACKET_VNET_HDR on", dev);
  /* Our own sends to the host must not come back to us as "outgoing" frames. */
  if (setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0)
    die("PACKET_IGNORE_OUTGOING on", dev);
  setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof big);
  struct sockaddr_ll sll = {0};
  sll.sll_family = AF_PACKET;
  sll.sll_protocol = htons(ETH_P_ALL);
  sll.sll_ifindex = (int)if_nametoindex(dev);
  if (sll.sll_ifindex == 0) die("no interface", dev);
  if (bind(fd, (struct sockaddr *)&sll, sizeof sll) < 0) die("bind to", dev);
  /* Frames from the host are addressed to other hosts' MACs, not to DEV's. */
  struct packet_mreq mr = {0};
  mr.mr_ifindex = sll.sll_ifindex;
  mr.mr_type = PACKET_MR_PROMISC;
  if (setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof mr) < 0)
    die("promiscuous mode on", dev);
  return fd;
}

static int open_tap(const char *name, int tso) {
  int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) die("open", "/dev/net/tun");
  struct ifreq ifr = {0};
  ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
  strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
  if (ioctl(fd, TUNSETIFF, &ifr) < 0) die("TUNSETIFF", name);
  /* With TSO the bridge hands us whole super-packets; without it the kernel cuts them
   * into wire frames first, so that loss drops single frames (TSO=0 when loss > 0). */
  unsigned off = TUN_F_CSUM | (tso ? TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN : 0);
  if (ioctl(fd, TUNSETOFFLOAD, off) < 0) die("TUNSETOFFLOAD", name);
  return fd;
}

static void init_queue(struct queue *q, int in_fd, int out_fd, const char *spec[]) {
  q->delay_ns = strtoull(spec[2], NULL, 10);
  q->jitter_ns = strtoull(spec[3], NULL, 10);
  q->loss = strtod(spec[4], NULL);
  q->cap = strtoull(spec[5], NULL, 10);
  q->buf = malloc(q->cap); /* pages become resident only as the ring reaches them */
  if (q->buf == NULL) die("cannot allocate the buffer of", spec[0]);
  q->in_fd = in_fd;
  q->out_fd = out_fd;
}

static void add_link(const char *arg) {
  char *copy = strdup(arg), *save = NULL;
  const char *f[7];
  int n = 0;
  for (char *tok = strtok_r(copy, ",", &save); tok && n < 7; tok = strtok_r(NULL, ",", &save))
    f[n++] = tok;
  if (n != 7 || nlinks == MAX_LINKS) {
    fprintf(stderr, "thinwire-delayline: bad link %s (DEV,TAP,DELAY_NS,JITTER_NS,LOSS,"
                    "BUFFER,TSO)\n", arg);
    exit(2);
  }
  struct link *l = &links[nlinks++];
  snprintf(l->dev, IFNAMSIZ, "%s", f[0]);
  snprintf(l->tap, IFNAMSIZ, "%s", f[1]);
  l->pfd = open_packet(l->dev);
  l->tfd = open_tap(l->tap, atoi(f[6]));
  init_queue(&l->up, l->pfd, l->tfd, f);
  init_queue(&l->down, l->tfd, l->pfd, f);
}

int main(int argc, char **argv) {
  int first = 1;
  if (argc > 2 && strcmp(argv[1], "--seed") == 0) {
    rng_state ^= strtoull(argv[2], NULL, 10) * 0xbf58476d1ce4e5b9ull;
    first = 3;
  }
  if (first >= argc) {
    fprintf(stderr, "usage: thinwire-delayline [--seed N] DEV,TAP,DELAY_NS,JITTER_NS,LOSS,"
                    "BUFFER,TSO ...\n");
    return 2;
  }
  /* Timers fire when asked, not up to 50 us later (the default slack). A frame's delay
   * is only as good as our wake-ups: on a machine busy with training, a nice of -10
   * lets this short, event-driven work preempt the training processes (netem runs in
   * the kernel's softirq, ahead of every process). Failing that, we run as we are. */
  prctl(PR_SET_TIMERSLACK, 1UL);
  if (setpriority(PRIO_PROCESS, 0, -10) != 0) { /* not root: keep the default */
  }
  for (int i = first; i < argc; i++) add_link(argv[i]);

  int ep = epoll_create1(EPOLL_CLOEXEC);
  int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  sigaddset(&mask, SIGUSR1);
  sigprocmask(SIG_BLOCK, &mask, NULL);
  int sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
  if (ep < 0 || tfd < 0 || sfd < 0) die("epoll/timerfd/signalfd", NULL);
  struct epoll_event ev = {.events = EPOLLIN};
  ev.data.u32 = 0xfffffffe;
  epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev);
  ev.data.u32 = 0xffffffff;
  epoll_ctl(ep, EPOLL_CTL_ADD, sfd, &ev);
  for (int i = 0; i < nlinks; i++) {
    ev.data.u32 = (uint32_t)(2 * i);
    if (epoll_ctl(ep, EPOLL_CTL_ADD, links[i].pfd, &ev) < 0) die("epoll_ctl", links[i].dev);
    ev.data.u32 = (uint32_t)(2 * i + 1);
    if (epoll_ctl(ep, EPOLL_CTL_ADD, links[i].tfd, &ev) < 0) die("epoll_ctl", links[i].tap);
  }
  printf("ready\n");
  fflush(stdout);

  /* A timer fires some tens of microseconds after its time (the wake-up of a process on
   * a busy machine). That lateness is learned (a moving average) and the timer is set
   * that much early, frames due within it being sent, so frames leave on average on
   * time: without it, 1 ms of delay measured 1.07 ms per pass on a 2-core machine. */
  uint64_t armed = 0, armed_for = 0, slack = 0;
  struct epoll_event evs[2 * MAX_LINKS + 2];
  for (;;) {
    int n = epoll_wait(ep, evs, 2 * MAX_LINKS + 2, -1);
    if (n < 0 && errno != EINTR) die("epoll_wait", NULL);
    for (int e = 0; e < n; e++) {
      uint32_t id = evs[e].data.u32;
      if (id == 0xfffffffe) {
        uint64_t ticks;
        if (read(tfd, &ticks, sizeof ticks) == (ssize_t)sizeof ticks && armed) {
          uint64_t t = now_ns();
          int64_t late = t > armed ? (int64_t)(t - armed) : 0;
          if (late > MAX_SLACK_NS) late = MAX_SLACK_NS;
          slack = (uint64_t)((7 * (int64_t)slack + late) / 8);
        }
        armed = armed_for = 0;
        continue;
      }
      if (id == 0xffffffff) {
        struct signalfd_siginfo si;
        while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
          print_stats();
          if (si.ssi_signo != SIGUSR1) return 0;
        }
        continue;
      }
      struct link *l = &links[id / 2];
      if (evs[e].events & (EPOLLERR | EPOLLHUP)) {
        fprintf(stderr, "thinwire-delayline: %s is gone, exiting\n", id % 2 ? l->tap : l->dev);
        print_stats();
        return 0;
      }
      if (id % 2 == 0) drain(&l->up, 1);
      else drain(&l->down, 0);
    }
    uint64_t t = now_ns() + slack, next = 0;
    for (int i = 0; i < nlinks; i++) {
      uint64_t a = flush(&links[i].up, t), b = flush(&links[i].down, t);
      if (a && (!next || a < next)) next = a;
      if (b && (!next || b < next)) next = b;
    }
    if (next && next != armed_for) {
      uint64_t at = next - slack;
      struct itimerspec its = {0};
      its.it_value.tv_sec = (time_t)(at / 1000000000ull);
      its.it_value.tv_nsec = (long)(at % 1000000000ull);
      timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
      armed = at;
      armed_for = next;
    }
  }
}
