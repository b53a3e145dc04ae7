// Command route routes a request with libkvroute through cgo and prints the decision: the Go
// counterpart of ffi/examples/route.c.
//
// Build and run against the build tree (from the repository root):
//
//	cargo build --release -p kvroute-ffi
//	export PKG_CONFIG_PATH=$PWD/target/release LD_LIBRARY_PATH=$PWD/target/release
//	(cd ffi/examples/go && go run .)
//
// It exits 0 when both routes succeeded and the repeated request went where the first one did.
package main

/*
#cgo pkg-config: kvroute
#include <stdlib.h>
#include "kvroute.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"unsafe"
)

// Error is a failed libkvroute call: its result code and the library's message.
type Error struct {
	Code    int32
	Message string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s", C.GoString(C.kvroute_result_name(C.kvroute_result(e.Code))), e.Message)
}

// check turns a result code into an error carrying this thread's last error message. cgo calls
// may move between OS threads, so the message is read on the same locked thread by the caller
// (main locks it; see main).
func check(r C.kvroute_result) error {
	if r == C.KVROUTE_RESULT_OK {
		return nil
	}
	var buf [1024]C.char
	msg := ""
	if C.kvroute_last_error_message(&buf[0], C.size_t(len(buf)), nil) == C.KVROUTE_RESULT_OK {
		msg = C.GoString(&buf[0])
	}
	return &Error{Code: int32(r), Message: msg}
}

// copyOut runs a "strings out" accessor twice: a size query, then the copy. ABSENT gives "".
func copyOut(get func(buf *C.char, n C.size_t, needed *C.size_t) C.kvroute_result) (string, error) {
	var need C.size_t
	r := get(nil, 0, &need)
	if r == C.KVROUTE_RESULT_ABSENT {
		return "", nil
	}
	if r != C.KVROUTE_RESULT_BUFFER_TOO_SMALL {
		return "", check(r)
	}
	buf := (*C.char)(C.malloc(need))
	defer C.free(unsafe.Pointer(buf))
	if err := check(get(buf, need, nil)); err != nil {
		return "", err
	}
	return C.GoString(buf), nil
}

// Router owns a kvroute_router.
type Router struct{ p *C.kvroute_router }

// NewRouter creates a router from a JSON (or YAML) policy document.
func NewRouter(policy string) (*Router, error) {
	cs := C.CString(policy)
	defer C.free(unsafe.Pointer(cs))
	var r *C.kvroute_router
	if err := check(C.kvroute_router_new(cs, C.size_t(len(policy)), &r)); err != nil {
		return nil, err
	}
	return &Router{r}, nil
}

// Close frees the router.
func (r *Router) Close() { C.kvroute_router_free(r.p); r.p = nil }

// AddEndpoint registers a decode endpoint and its metrics.
func (r *Router) AddEndpoint(id string, waiting uint32, kvUsage float64, nowMs uint64) error {
	cid := C.CString(id)
	defer C.free(unsafe.Pointer(cid))
	if err := check(C.kvroute_router_upsert_endpoint(r.p, cid, C.KVROUTE_ROLE_DECODE)); err != nil {
		return err
	}
	var m C.kvroute_metrics // zero value: the optional fields are unset
	m.waiting = C.uint32_t(waiting)
	m.running = 4
	m.kv_usage = C.double(kvUsage)
	m.updated_ms = C.uint64_t(nowMs)
	return check(C.kvroute_router_update_metrics(r.p, cid, &m))
}

// Route routes one request body with headers. The header strings are copied to C memory: cgo
// forbids passing C a Go array that holds Go pointers.
func (r *Router) Route(body string, headers map[string]string, nowMs uint64) (*Decision, error) {
	hs := (*[64]C.kvroute_header)(C.malloc(C.size_t(unsafe.Sizeof(C.kvroute_header{})) * 64))
	defer C.free(unsafe.Pointer(hs))
	n := 0
	for k, v := range headers {
		if n == len(hs) {
			return nil, errors.New("too many headers")
		}
		hs[n].name, hs[n].name_len = C.CString(k), C.size_t(len(k))
		hs[n].value, hs[n].value_len = C.CString(v), C.size_t(len(v))
		defer C.free(unsafe.Pointer(hs[n].name))
		defer C.free(unsafe.Pointer(hs[n].value))
		n++
	}
	cb := C.CString(body)
	defer C.free(unsafe.Pointer(cb))
	var d *C.kvroute_decision
	if err := check(C.kvroute_router_route(r.p, cb, C.size_t(len(body)), &hs[0], C.size_t(n), C.uint64_t(nowMs), &d)); err != nil {
		return nil, err
	}
	return &Decision{d}, nil
}

// Complete releases a finished request's in-flight counters.
func (r *Router) Complete(requestID string) error {
	cid := C.CString(requestID)
	defer C.free(unsafe.Pointer(cid))
	return check(C.kvroute_router_complete(r.p, cid))
}

// Decision owns a kvroute_decision.
type Decision struct{ p *C.kvroute_decision }

// Close frees the decision.
func (d *Decision) Close() { C.kvroute_decision_free(d.p); d.p = nil }

func (d *Decision) text(get func(*C.kvroute_decision, *C.char, C.size_t, *C.size_t) C.kvroute_result) (string, error) {
	return copyOut(func(buf *C.char, n C.size_t, need *C.size_t) C.kvroute_result { return get(d.p, buf, n, need) })
}

// RequestID is the id to pass to Complete.
func (d *Decision) RequestID() (string, error) {
	return d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
		return C.kvroute_decision_request_id(p, b, n, need)
	})
}

// Endpoint is the target endpoint ("" when shed).
func (d *Decision) Endpoint() (string, error) {
	return d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
		return C.kvroute_decision_endpoint(p, b, n, need)
	})
}

// PrefillEndpoint is the prefill endpoint ("" unless disaggregated).
func (d *Decision) PrefillEndpoint() (string, error) {
	return d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
		return C.kvroute_decision_prefill_endpoint(p, b, n, need)
	})
}

// Headers are the headers to set on the upstream request, in order.
func (d *Decision) Headers() ([][2]string, error) {
	var out [][2]string
	for i := C.size_t(0); i < C.kvroute_decision_header_count(d.p); i++ {
		name, err := d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
			return C.kvroute_decision_header_name(p, i, b, n, need)
		})
		if err != nil {
			return nil, err
		}
		value, err := d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
			return C.kvroute_decision_header_value(p, i, b, n, need)
		})
		if err != nil {
			return nil, err
		}
		out = append(out, [2]string{name, value})
	}
	return out, nil
}

func name(p *C.char) string {
	if p == nil {
		return "-"
	}
	return C.GoString(p)
}

func (d *Decision) print() error {
	id, err := d.RequestID()
	if err != nil {
		return err
	}
	ep, err := d.Endpoint()
	if err != nil {
		return err
	}
	prefill, err := d.PrefillEndpoint()
	if err != nil {
		return err
	}
	headers, err := d.Headers()
	if err != nil {
		return err
	}
	fmt.Printf("  request id:       %s\n", id)
	fmt.Printf("  mode:             %s\n", name(C.kvroute_mode_name(C.kvroute_decision_mode(d.p))))
	fmt.Printf("  rule:             %s\n", name(C.kvroute_rule_name(C.kvroute_decision_rule(d.p))))
	fmt.Printf("  endpoint:         %s\n", ep)
	fmt.Printf("  prefill endpoint: %s\n", map[bool]string{true: "-", false: prefill}[prefill == ""])
	fmt.Printf("  policy version:   %d\n", uint64(C.kvroute_decision_policy_version(d.p)))
	fmt.Printf("  prefix hit:       %.2f\n", float64(C.kvroute_decision_prefix_hit(d.p)))
	fmt.Printf("  headers:\n")
	for _, h := range headers {
		fmt.Printf("    %s: %s\n", h[0], h[1])
	}
	fmt.Printf("  scores:\n")
	for i := C.size_t(0); i < C.kvroute_decision_score_count(d.p); i++ {
		ep, err := d.text(func(p *C.kvroute_decision, b *C.char, n C.size_t, need *C.size_t) C.kvroute_result {
			return C.kvroute_decision_score_endpoint(p, i, b, n, need)
		})
		if err != nil {
			return err
		}
		var s C.kvroute_endpoint_score
		if err := check(C.kvroute_decision_score(d.p, i, &s)); err != nil {
			return err
		}
		fmt.Printf("    %-15s total %.3f (prefix hit %.2f, queue %.2f, kv usage %.2f)\n", ep,
			float64(s.total), float64(s.prefix_hit), float64(s.queue), float64(s.kv_usage))
	}
	return nil
}

func run() error {
	fmt.Printf("libkvroute %s (from Go)\n", C.GoString(C.kvroute_version()))
	router, err := NewRouter(`{"metrics": {"staleness_ms": 60000}}`)
	if err != nil {
		return err
	}
	defer router.Close()
	now := uint64(C.kvroute_now_ms())
	for i, ep := range []string{"10.0.0.1:8000", "10.0.0.2:8000"} {
		if err := router.AddEndpoint(ep, uint32(i), 0.25, now); err != nil {
			return err
		}
	}
	system := strings.Repeat("You are a careful assistant; cite the documents you were given. ", 60)
	body := fmt.Sprintf(`{"model":"llama","max_tokens":512,"messages":[{"role":"system","content":%q},`+
		`{"role":"user","content":"What changed in the last release?"}]}`, system)
	var targets []string
	for round := 1; round <= 2; round++ {
		d, err := router.Route(body, map[string]string{"x-session-id": "session-42"}, now+uint64(round))
		if err != nil {
			return err
		}
		fmt.Printf("decision %d:\n", round)
		if err := d.print(); err != nil {
			d.Close()
			return err
		}
		ep, _ := d.Endpoint()
		targets = append(targets, ep)
		id, err := d.RequestID()
		d.Close()
		if err != nil {
			return err
		}
		if err := router.Complete(id); err != nil {
			return err
		}
	}
	if targets[0] != targets[1] {
		return fmt.Errorf("the repeated request went to %s, not to %s where its prefix is cached", targets[1], targets[0])
	}
	// Bad input is a typed error, never a crash.
	if _, err := router.Route(`{"prompt": 1}`, nil, now); err == nil {
		return errors.New("a malformed body was routed")
	} else {
		var e *Error
		if !errors.As(err, &e) || e.Code != C.KVROUTE_RESULT_REQUEST_ERROR {
			return fmt.Errorf("a malformed body gave %v, expected KVROUTE_RESULT_REQUEST_ERROR", err)
		}
		fmt.Printf("malformed body: %v\n", err)
	}
	return nil
}

func main() {
	// The last error is per OS thread: keep this goroutine on one thread so that a failed call
	// and the read of its message happen on the same thread.
	runtime.LockOSThread()
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
