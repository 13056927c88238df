/* LD_PRELOAD shim: TCP_NODELAY on every TCP socket a process accepts.
 *
 * sglang-router 0.3.2 (axum_server) never sets TCP_NODELAY on the client connections it accepts,
 * so the first body bytes of a streamed reply wait behind Nagle for the client's delayed ACK
 * (~40 ms on Linux) when a keep-alive connection is reused. The benchmark runs a second
 * sglang-router target with this library preloaded to measure its routing cost without that stall.
 * Built at run time by bench/nodelay/__init__.py (gcc -shared -fPIC); never committed as a binary.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

static void nodelay(int fd) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    int type = 0, one = 1;
    socklen_t tlen = sizeof type;
    if (fd < 0 || getsockname(fd, (struct sockaddr *)&ss, &len) != 0) return;
    if (ss.ss_family != AF_INET && ss.ss_family != AF_INET6) return;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) != 0 || type != SOCK_STREAM) return;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int accept(int fd, struct sockaddr *addr, socklen_t *len) {
    static int (*real)(int, struct sockaddr *, socklen_t *);
    if (!real) real = (int (*)(int, struct sockaddr *, socklen_t *))dlsym(RTLD_NEXT, "accept");
    int c = real(fd, addr, len);
    nodelay(c);
    return c;
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    static int (*real)(int, struct sockaddr *, socklen_t *, int);
    if (!real) real = (int (*)(int, struct sockaddr *, socklen_t *, int))dlsym(RTLD_NEXT, "accept4");
    int c = real(fd, addr, len, flags);
    nodelay(c);
    return c;
}
