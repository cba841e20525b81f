/*
 * stress.c - the real latch code paths (latch_publish, latch_read from
 * kvsidecar/protocol/_seqlock.c, compiled without Python) under one full-speed
 * writer thread and N reader threads. Built for aarch64 and run under
 * qemu-aarch64 by tests/protocol/test_aarch64_stress.py.
 *
 * What it proves: the aarch64 build of the latch builds, runs and accepts no torn
 * snapshot. What it cannot: on an x86-64 host, qemu's translated code runs with
 * the host's (TSO) ordering, so the reorderings the fences exist for never occur;
 * that part is the job of the fence checks (test_fences_*.py) and real hardware.
 *
 * The oracle is independent of the CRC: every payload byte is a function of its
 * snapshot's sequence number, so a mix of two snapshots is seen even if its CRC
 * happened to match.
 *
 * usage: stress SECONDS READERS   prints: reads=.. ok=.. retries=.. torn=.. published=..
 */
#define KVSIDECAR_LATCH_ONLY
#ifndef LATCH_SOURCE /* the test points this at a mutated copy to show the oracle has teeth */
#define LATCH_SOURCE "../../../kvsidecar/protocol/_seqlock.c"
#endif
#include LATCH_SOURCE

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define SLOT_OFF 512
#define CAP 4096
#define STRIDE (SLOT_HEADER_LEN + CAP)
#define SEG_LEN (SLOT_OFF + 2 * STRIDE)

static _Alignas(64) uint8_t segment[SEG_LEN];
static volatile int stop = 0;

static uint32_t payload_len(uint64_t k) { return 256 + (uint32_t)(k * 2654435761u % 3000); }
static uint8_t payload_byte(uint64_t k, uint32_t i) { return (uint8_t)(k * 131 + i * 7 + (k >> 8)); }

static void *writer(void *arg) {
    uint64_t *published = arg;
    uint8_t buf[CAP];
    for (uint64_t k = 1; !stop; k++) {
        uint32_t n = payload_len(k);
        for (uint32_t i = 0; i < n; i++) buf[i] = payload_byte(k, i);
        uint64_t got = 0;
        uint32_t cap = 0;
        if (latch_publish(segment, SEG_LEN, buf, n, &got, &cap) != ST_OK || got != k) {
            fprintf(stderr, "publish %llu failed\n", (unsigned long long)k);
            exit(2);
        }
        *published = k;
    }
    return NULL;
}

struct counts {
    unsigned long long reads, ok, retries, torn;
};

static void *reader(void *arg) {
    struct counts *c = arg;
    uint8_t *scratch = malloc(CAP + SLOT_HEADER_LEN);
    while (!stop) {
        uint64_t s = 0;
        uint32_t n = 0;
        int attempts = 0;
        int status = latch_read(segment, SLOT_OFF, STRIDE, CAP, 8, scratch, &s, &n, &attempts);
        c->reads++;
        if (attempts > 1) c->retries += (unsigned long long)attempts - 1;
        if (status != ST_OK) continue;
        c->ok++;
        int bad = n != payload_len(s);
        for (uint32_t i = 0; !bad && i < n; i++) bad = scratch[SLOT_HEADER_LEN + i] != payload_byte(s, i);
        if (bad) c->torn++;
    }
    free(scratch);
    return NULL;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    int readers = argc > 2 ? atoi(argv[2]) : 2;
    if (readers < 1 || readers > 64) return 2;
    crc_init();
    install_guard();
    memcpy(segment + OFF_SLOT_OFF, &(uint32_t){SLOT_OFF}, 4);
    memcpy(segment + OFF_SLOT_STRIDE, &(uint32_t){STRIDE}, 4);
    memcpy(segment + OFF_SLOT_CAPACITY, &(uint32_t){CAP}, 4);
    uint64_t published = 0;
    struct counts counts[64] = {{0}};
    pthread_t w, r[64];
    pthread_create(&w, NULL, writer, &published);
    for (int i = 0; i < readers; i++) pthread_create(&r[i], NULL, reader, &counts[i]);
    struct timespec ts = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
    stop = 1;
    pthread_join(w, NULL);
    struct counts total = {0};
    for (int i = 0; i < readers; i++) {
        pthread_join(r[i], NULL);
        total.reads += counts[i].reads;
        total.ok += counts[i].ok;
        total.retries += counts[i].retries;
        total.torn += counts[i].torn;
    }
    printf("reads=%llu ok=%llu retries=%llu torn=%llu published=%llu\n", total.reads, total.ok,
           total.retries, total.torn, (unsigned long long)published);
    return total.torn == 0 ? 0 : 1;
}
