/* The ZMQ KV-event subscription through the C API, against a loopback publisher written here
 * with libzmq that speaks vLLM's framing ([topic, seq as 8 bytes big-endian, msgpack payload]).
 * The publisher is an XPUB socket: it waits for the subscription message before publishing, so
 * there is no slow-joiner sleep. Every wait is bounded. Skipped (passes) when the library was
 * built without the `zmq` feature. */
#define _POSIX_C_SOURCE 200809L
#include <time.h>

#include <zmq.h>

#include "common.h"

static const char *D1 = "127.0.0.1:8001";
static const char *D2 = "127.0.0.1:8002";

/* A vLLM BlockStored batch (map encoding) of 2 blocks of 16 tokens, token ids 0..31. */
static const char *EVENT_HEX =
    "93cb3ff000000000000091"
    "88a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b1706172656e745f626c6f636b5f68617368"
    "c0a9746f6b656e5f696473dc0020000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f63"
    "6b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000";

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void publish(void *pub, const char *topic, uint64_t seq, const void *payload, size_t len) {
    unsigned char be[8];
    for (int i = 0; i < 8; i++) be[i] = (unsigned char)(seq >> (56 - 8 * i));
    CHECK(zmq_send(pub, topic, strlen(topic), ZMQ_SNDMORE) >= 0);
    CHECK(zmq_send(pub, be, 8, ZMQ_SNDMORE) == 8);
    CHECK(zmq_send(pub, payload, len, 0) == (int)len);
}

/* Wait (30 s at most: valgrind on a busy machine is slow) until `field` of the subscription's stats reaches `want`. */
#define WAIT_FOR(sub, field, want)                                                  \
    do {                                                                            \
        kvroute_subscriber_stats st_;                                               \
        double until_ = seconds() + 30.0;                                           \
        do {                                                                        \
            CHECK_OK(kvroute_subscription_stats(sub, &st_));                        \
            if (st_.field >= (want)) break;                                         \
            sleep_ms(5);                                                            \
        } while (seconds() < until_);                                               \
        CHECK(st_.field == (want));                                                 \
    } while (0)

int main(void) {
    kvroute_router *r = NULL;
    const char *policy = "{\"index\": {\"mode\": \"precise\", \"block_tokens\": 16}}";
    CHECK_OK(kvroute_router_new(policy, strlen(policy), &r));
    uint64_t now = kvroute_now_ms();
    const char *eps[] = {D1, D2};
    for (int i = 0; i < 2; i++) {
        CHECK_OK(kvroute_router_upsert_endpoint(r, eps[i], KVROUTE_ROLE_DECODE));
        kvroute_metrics m = {0};
        m.waiting = (uint32_t)(1 - i); /* D1 has the queue: only the cache can send work to D2 */
        m.kv_usage = 0.2;
        m.updated_ms = now;
        CHECK_OK(kvroute_router_update_metrics(r, eps[i], &m));
    }

    /* Probe: without the feature, start says so and the test has nothing more to do. */
    kvroute_subscriber_config probe = {0};
    probe.endpoint = "tcp://127.0.0.1:*";
    probe.mode = KVROUTE_SOCKET_MODE_BIND;
    kvroute_subscription *bound = NULL;
    kvroute_result res = kvroute_subscription_start(r, D1, &probe, &bound);
    if (res == KVROUTE_RESULT_UNSUPPORTED) {
        printf("subscribe: built without zmq, skipped\n");
        kvroute_router_free(r);
        return finish("subscribe");
    }
    CHECK(res == KVROUTE_RESULT_OK);
    /* A bind to port *: the chosen port is reported. */
    char local[128];
    CHECK_OK(kvroute_subscription_local_endpoint(bound, local, sizeof local, NULL));
    CHECK(strncmp(local, "tcp://127.0.0.1:", 16) == 0 && strchr(local + 16, '*') == NULL);
    CHECK(kvroute_subscription_is_running(bound));
    kvroute_subscription_free(bound); /* frees a running subscription: stops it */

    /* The publisher. */
    void *ctx = zmq_ctx_new();
    void *pub = zmq_socket(ctx, ZMQ_XPUB);
    int linger = 0, timeout = 10000;
    zmq_setsockopt(pub, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(pub, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    CHECK(zmq_bind(pub, "tcp://127.0.0.1:*") == 0);
    char addr[128];
    size_t addr_len = sizeof addr;
    CHECK(zmq_getsockopt(pub, ZMQ_LAST_ENDPOINT, addr, &addr_len) == 0);

    kvroute_subscriber_config cfg = {0};
    cfg.endpoint = addr;
    cfg.mode = KVROUTE_SOCKET_MODE_CONNECT;
    cfg.topic = "kv@";
    cfg.poll_interval_ms = 20;
    kvroute_subscription *sub = NULL;
    CHECK_OK(kvroute_subscription_start(r, D2, &cfg, &sub));
    if (sub == NULL) return finish("subscribe");
    char buf[128];
    CHECK_OK(kvroute_subscription_endpoint(sub, buf, sizeof buf, NULL));
    CHECK_STR(buf, D2);
    CHECK_OK(kvroute_subscription_local_endpoint(sub, buf, sizeof buf, NULL));
    CHECK_STR(buf, addr);

    /* Wait for the subscription message (\x01 + topic). */
    unsigned char msg[64];
    int n = zmq_recv(pub, msg, sizeof msg, 0);
    CHECK(n == 4 && msg[0] == 1 && memcmp(msg + 1, "kv@", 3) == 0);

    size_t len = 0;
    unsigned char *payload = hex_decode(EVENT_HEX, &len);
    publish(pub, "kv@engine-2", 0, payload, len);
    WAIT_FOR(sub, applied, 1u);
    publish(pub, "other-topic", 1, payload, len); /* filtered out by the topic prefix */
    publish(pub, "kv@engine-2", 0, payload, len); /* duplicate */
    WAIT_FOR(sub, duplicates, 1u);
    const unsigned char garbage[] = {0xc1, 0xc1};
    publish(pub, "kv@engine-2", 1, garbage, sizeof garbage);
    WAIT_FOR(sub, decode_errors, 1u);
    CHECK(kvroute_subscription_is_running(sub));

    /* The events reached the router: token ids 0..31 are cached on D2. */
    const char *body = "{\"model\":\"m\",\"prompt\":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,"
                       "24,25,26,27,28,29,30,31],\"max_tokens\":300}";
    kvroute_decision *d = NULL;
    CHECK_OK(kvroute_router_route(r, body, strlen(body), NULL, 0, kvroute_now_ms(), &d));
    CHECK_OK(kvroute_decision_endpoint(d, buf, sizeof buf, NULL));
    CHECK_STR(buf, D2);
    kvroute_endpoint_score s;
    CHECK_OK(kvroute_decision_score(d, 1, &s));
    CHECK(s.precise && s.matched_blocks == 2);
    kvroute_decision_free(d);

    /* The router handle may be freed before the subscription. */
    kvroute_router_free(r);
    publish(pub, "kv@engine-2", 1, payload, len); /* seq 1 again, decodable this time */
    WAIT_FOR(sub, applied, 2u);

    kvroute_subscriber_stats final_stats, again;
    memset(&final_stats, 0, sizeof final_stats);
    CHECK_OK(kvroute_subscription_stop(sub, &final_stats));
    CHECK(!kvroute_subscription_is_running(sub));
    CHECK(final_stats.applied == 2 && final_stats.duplicates == 1 && final_stats.decode_errors == 1);
    CHECK(final_stats.messages == 4 && final_stats.gaps == 0 && final_stats.router_errors == 0);
    CHECK_OK(kvroute_subscription_stop(sub, &again));
    CHECK(memcmp(&again, &final_stats, sizeof again) == 0);
    CHECK_OK(kvroute_subscription_stats(sub, &again));
    CHECK(again.applied == 2);
    kvroute_subscription_free(sub);
    free(payload);
    zmq_close(pub);
    zmq_ctx_term(ctx);
    return finish("subscribe");
}
