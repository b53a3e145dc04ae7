//! Slow and stalled HTTP clients (loopback only): the header and body read timeouts close
//! stalled connections, and connections beyond `max_connections` are turned away while requests
//! on the admitted ones still complete.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use kvroute_worker::{spawn, WorkerConfig};

/// How long a client waits for the server to close a stalled connection: ten times the
/// server-side timeouts of these tests (1 s), so machine load cannot fail them.
const CLOSE_BOUND: Duration = Duration::from_secs(10);

/// How a stalled client stops.
#[derive(Debug, Clone, Copy)]
enum Stall {
    /// Connects and sends nothing.
    Silent,
    /// Sends part of the request line and headers.
    PartialHeaders,
    /// Sends whole headers announcing 1000 body bytes, then 10 of them.
    PartialBody,
}

fn stalled(addr: SocketAddr, how: Stall) -> TcpStream {
    let mut s = TcpStream::connect_timeout(&addr, CLOSE_BOUND).unwrap();
    let bytes: &[u8] = match how {
        Stall::Silent => b"",
        Stall::PartialHeaders => b"POST /v1/completions HTTP/1.1\r\nHost: worker\r\nContent-Ty",
        Stall::PartialBody => {
            b"POST /v1/completions HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":"
        }
    };
    s.write_all(bytes).unwrap();
    s
}

/// What the server did with a connection, seen by a client reading until `CLOSE_BOUND`.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// End of stream (or a reset) within the bound; `status` of a response read before it.
    Closed { status: Option<u16> },
    /// Still open after the bound.
    Open,
}

fn watch(mut s: TcpStream) -> Seen {
    let start = Instant::now();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = CLOSE_BOUND.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Seen::Open;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return Seen::Open,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // A reset (the server closed with unread input) is a close too.
            Err(_) => break,
        }
    }
    let status = std::str::from_utf8(&raw)
        .ok()
        .and_then(|t| t.strip_prefix("HTTP/1.1 "))
        .and_then(|t| t.get(..3))
        .and_then(|c| c.parse().ok());
    Seen::Closed { status }
}

/// Watch every connection at once (one thread each); the results in order.
fn watch_all(conns: Vec<TcpStream>) -> Vec<Seen> {
    let threads: Vec<_> = conns.into_iter().map(|s| std::thread::spawn(move || watch(s))).collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn slow_client_config(max_connections: usize) -> WorkerConfig {
    WorkerConfig {
        header_read_timeout_ms: 1000,
        body_read_timeout_ms: 1000,
        max_connections,
        kv_events: kvroute_worker::config::KvEventsConfig { endpoint: None, ..Default::default() },
        ..tiny(64)
    }
}

/// Scaled-down reproduction of "800 stalled connections stayed open past 75 s": 24 stalled
/// connections (silent, partial headers, partial body) against 1 s read timeouts must all be
/// closed within 10 s; the partial bodies get 408 first. Then the worker serves as before.
#[test]
fn stalled_connections_are_closed_by_the_read_timeouts() {
    let w = spawn(slow_client_config(64)).unwrap();
    let addr = w.http_addr();
    let kinds = [Stall::Silent, Stall::PartialHeaders, Stall::PartialBody];
    let conns: Vec<_> = (0..24).map(|i| stalled(addr, kinds[i % 3])).collect();
    let seen = watch_all(conns);
    let open = seen.iter().filter(|s| **s == Seen::Open).count();
    println!("stalled connections still open after {CLOSE_BOUND:?}: {open} of {}", seen.len());
    assert_eq!(open, 0, "{seen:?}");
    for (i, s) in seen.iter().enumerate() {
        match kinds[i % 3] {
            Stall::PartialBody => assert_eq!(*s, Seen::Closed { status: Some(408) }, "connection {i}"),
            Stall::Silent | Stall::PartialHeaders => {
                assert_eq!(*s, Seen::Closed { status: None }, "connection {i}: closed without a response");
            }
        }
    }
    // The worker still serves.
    let out = complete(addr, &prompt(3, 20, 300), 2);
    assert_eq!(out["usage"]["completion_tokens"], 2);
    w.shutdown();
}

/// A body that arrives slowly but whole within the body timeout is served (the timeout bounds
/// the whole body, it does not fail a request merely for arriving in pieces).
#[test]
fn a_body_sent_in_pieces_within_the_timeout_is_served() {
    let w = spawn(WorkerConfig { body_read_timeout_ms: 5000, ..slow_client_config(8) }).unwrap();
    let addr = w.http_addr();
    let body = br#"{"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 2}"#;
    let mut s = TcpStream::connect_timeout(&addr, CLOSE_BOUND).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: worker\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    for piece in body.chunks(16) {
        std::thread::sleep(Duration::from_millis(50));
        s.write_all(piece).unwrap();
    }
    assert_eq!(watch(s), Seen::Closed { status: Some(200) });
    w.shutdown();
}

/// With `max_connections = 4`: one well-behaved connection and three stalled ones fill the
/// limit; a fifth connection is turned away (503 or closed) while the well-behaved one still
/// gets its completion; once the stalled clients go away the worker accepts again.
#[test]
fn connections_beyond_the_limit_are_turned_away() {
    // Long timeouts here: the stalled connections must hold their slots during the test.
    let cfg = WorkerConfig { header_read_timeout_ms: 60_000, body_read_timeout_ms: 60_000, ..slow_client_config(4) };
    let w = spawn(cfg).unwrap();
    let addr = w.http_addr();
    // Connections are accepted in the order they were made.
    let mut good = TcpStream::connect_timeout(&addr, CLOSE_BOUND).unwrap();
    let stalls: Vec<_> = (0..3).map(|_| stalled(addr, Stall::PartialHeaders)).collect();
    // A client beyond the limit that reads first gets the 503 and the close.
    let quiet = TcpStream::connect_timeout(&addr, CLOSE_BOUND).unwrap();
    let turned_away = watch(quiet);
    println!("connection beyond the limit: {turned_away:?}");
    assert_eq!(turned_away, Seen::Closed { status: Some(503) });
    // One that sends its request at once sees the close (its unsent-to-the-app request may make
    // the close a reset that discards the 503).
    let mut eager = TcpStream::connect_timeout(&addr, CLOSE_BOUND).unwrap();
    // Best effort: the server may already have closed it.
    let _ = eager.write_all(b"GET /health HTTP/1.1\r\nHost: worker\r\nConnection: close\r\n\r\n");
    let turned_away = watch(eager);
    assert!(matches!(turned_away, Seen::Closed { status: None | Some(503) }), "beyond the limit: {turned_away:?}");

    // The admitted well-behaved connection still gets its completion.
    let body = br#"{"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 2}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: worker\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    good.write_all(head.as_bytes()).unwrap();
    good.write_all(body).unwrap();
    assert_eq!(watch(good), Seen::Closed { status: Some(200) });

    // The stalled clients leave: their slots free up and new connections are served again.
    drop(stalls);
    wait_until("a new connection is served after the stalled clients left", || {
        let mut s = TcpStream::connect_timeout(&addr, CLOSE_BOUND).unwrap();
        let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: worker\r\nConnection: close\r\n\r\n");
        watch(s) == Seen::Closed { status: Some(200) }
    });
    w.shutdown();
}
