//! A real `nats-server` (Debian's package; the test script installs it) on loopback with
//! JetStream and its storage in a temporary directory, killed on drop.
#![allow(
    dead_code,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)] // real sockets, processes, waits

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    pub token: Option<String>,
    pub dir: PathBuf,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free loopback port")
}

fn binary() -> String {
    std::env::var("KVROUTE_NATS_SERVER").unwrap_or_else(|_| "nats-server".into())
}

impl NatsServer {
    /// Start a server (token authentication when `token` is given). Panics with the reason when
    /// it cannot (the binary missing: `apt-get install nats-server`).
    pub fn start(token: Option<&str>) -> NatsServer {
        let dir = std::env::temp_dir().join(format!("kvroute-nats-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        let mut s = NatsServer { child: None, port: free_port(), token: token.map(str::to_owned), dir };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new(binary());
        cmd.args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(t) = &self.token {
            cmd.args(["--auth", t]);
        }
        let child =
            cmd.spawn().unwrap_or_else(|e| panic!("cannot start {} ({e}): apt-get install nats-server", binary()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not listen on {} within 20 s", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kill the server (its storage stays).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again on the same port and storage.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Poll `cond` every 10 ms until it holds or `secs` pass; the time it took.
pub fn wait_until(secs: u64, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) {
        if cond() {
            return Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond().then(|| t0.elapsed())
}
