/* epcomm's host transport over MPI: the callbacks of epcomm_host_callbacks as MPI calls
 * (MPI_Send / MPI_Recv / MPI_Allgather / MPI_Alltoallv), for examples/mpi/ep_mpi.c and
 * benches/mpi_ep.c. user_data is a pointer to the MPI_Comm. Header-only (static functions). */
#ifndef EPCOMM_MPI_TRANSPORT_H
#define EPCOMM_MPI_TRANSPORT_H

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include <epcomm.h>

/* MPI counts are int: larger messages go in chunks of 1 GiB. */
#define EPCOMM_MPI_CHUNK ((size_t)1 << 30)

static int32_t mpi_send(void *user, int32_t peer, const void *data, size_t bytes) {
    MPI_Comm comm = *(MPI_Comm *)user;
    const char *p = data;
    do {
        size_t n = bytes < EPCOMM_MPI_CHUNK ? bytes : EPCOMM_MPI_CHUNK;
        if (MPI_Send(p, (int)n, MPI_BYTE, peer, 0, comm) != MPI_SUCCESS) return 1;
        p += n;
        bytes -= n;
    } while (bytes > 0);
    return 0;
}

static int32_t mpi_recv(void *user, int32_t peer, void *data, size_t bytes) {
    MPI_Comm comm = *(MPI_Comm *)user;
    char *p = data;
    do {
        size_t n = bytes < EPCOMM_MPI_CHUNK ? bytes : EPCOMM_MPI_CHUNK;
        if (MPI_Recv(p, (int)n, MPI_BYTE, peer, 0, comm, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            return 1;
        p += n;
        bytes -= n;
    } while (bytes > 0);
    return 0;
}

static int32_t mpi_all_gather(void *user, const void *input, size_t bytes, void *output) {
    MPI_Comm comm = *(MPI_Comm *)user;
    if (bytes > EPCOMM_MPI_CHUNK) return 1; /* epcomm gathers small headers only */
    return MPI_Allgather(input, (int)bytes, MPI_BYTE, output, (int)bytes, MPI_BYTE, comm) !=
           MPI_SUCCESS;
}

/* Beyond int counts or displacements: every chunk as nonblocking sends and receives in pieces
 * of EPCOMM_MPI_CHUNK, all posted, then one wait. */
static int32_t mpi_all_to_allv_large(MPI_Comm comm, int world, const char *send,
                                     const size_t *send_bytes, char *recv,
                                     const size_t *recv_bytes) {
    size_t pieces = 0;
    for (int p = 0; p < world; p++)
        pieces += send_bytes[p] / EPCOMM_MPI_CHUNK + 1 + recv_bytes[p] / EPCOMM_MPI_CHUNK + 1;
    MPI_Request *req = malloc(pieces * sizeof *req);
    if (!req) return 1;
    int n = 0, bad = 0;
    for (int p = 0; p < world; p++) {
        for (size_t off = 0; off < recv_bytes[p] && !bad; off += EPCOMM_MPI_CHUNK) {
            size_t len = recv_bytes[p] - off < EPCOMM_MPI_CHUNK ? recv_bytes[p] - off : EPCOMM_MPI_CHUNK;
            bad |= MPI_Irecv(recv + off, (int)len, MPI_BYTE, p, 1, comm, &req[n++]) != MPI_SUCCESS;
        }
        recv += recv_bytes[p];
    }
    for (int p = 0; p < world; p++) {
        for (size_t off = 0; off < send_bytes[p] && !bad; off += EPCOMM_MPI_CHUNK) {
            size_t len = send_bytes[p] - off < EPCOMM_MPI_CHUNK ? send_bytes[p] - off : EPCOMM_MPI_CHUNK;
            bad |= MPI_Isend(send + off, (int)len, MPI_BYTE, p, 1, comm, &req[n++]) != MPI_SUCCESS;
        }
        send += send_bytes[p];
    }
    bad |= MPI_Waitall(n, req, MPI_STATUSES_IGNORE) != MPI_SUCCESS;
    free(req);
    return bad;
}

/* One MPI_Alltoallv of bytes (the large path above when a count or displacement exceeds int). */
static int32_t mpi_all_to_allv(void *user, const void *send, const size_t *send_bytes,
                               void *recv, const size_t *recv_bytes) {
    MPI_Comm comm = *(MPI_Comm *)user;
    int world;
    MPI_Comm_size(comm, &world);
    int *v = malloc(4 * (size_t)world * sizeof *v);
    if (!v) return 1;
    int *sc = v, *sd = v + world, *rc = v + 2 * world, *rd = v + 3 * world;
    size_t so = 0, ro = 0;
    int fits = 1;
    for (int p = 0; p < world; p++) {
        fits &= send_bytes[p] <= INT_MAX && recv_bytes[p] <= INT_MAX && so <= INT_MAX &&
                ro <= INT_MAX;
        sc[p] = (int)send_bytes[p];
        sd[p] = (int)so;
        rc[p] = (int)recv_bytes[p];
        rd[p] = (int)ro;
        so += send_bytes[p];
        ro += recv_bytes[p];
    }
    int32_t rc_ = fits ? MPI_Alltoallv(send, sc, sd, MPI_BYTE, recv, rc, rd, MPI_BYTE, comm) !=
                             MPI_SUCCESS
                       : mpi_all_to_allv_large(comm, world, send, send_bytes, recv, recv_bytes);
    free(v);
    return rc_;
}

/* The callbacks over *comm; with_all_to_allv = 0 leaves all_to_allv NULL (send/recv carry the
 * data, as hosts built before it did). */
static epcomm_host_callbacks mpi_callbacks(MPI_Comm *comm, int with_all_to_allv) {
    epcomm_host_callbacks cb;
    memset(&cb, 0, sizeof cb);
    cb.struct_size = (uint32_t)sizeof cb;
    cb.user_data = comm;
    cb.send = mpi_send;
    cb.recv = mpi_recv;
    cb.all_gather = mpi_all_gather;
    cb.all_to_allv = with_all_to_allv ? mpi_all_to_allv : NULL;
    return cb;
}

#endif
