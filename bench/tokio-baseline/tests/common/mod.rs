//! What every end-to-end test of the baseline starts from: the binary on ephemeral ports.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long the baseline may take to print its start-up line, and an admin GET to complete.
const WAIT: Duration = Duration::from_secs(20);

/// The baseline on ephemeral ports; killed on drop.
pub struct Broker {
    child: Child,
    pub rigs: String,
    pub admin: String,
    /// The start-up line, as printed.
    #[allow(dead_code)] // read by the TLS tests only
    pub banner: String,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the baseline with `--listen`/`--admin` on port 0 plus `args`, and reads the bound
/// ports from its start-up line ("... rigs on A admin on B ..."). The rest of its log goes to
/// the test's output under `tag` (shown when a test fails).
pub fn start(tag: &str, args: &[&str]) -> Broker {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fleetlink-tokio-baseline"))
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start baseline");
    let stderr = BufReader::new(child.stderr.take().expect("piped stderr"));
    // A thread reads stderr: the first line comes back over a channel (so the wait for it has
    // a deadline), the rest goes to the test's output.
    let (tx, rx) = mpsc::channel();
    let tag = tag.to_string();
    std::thread::spawn(move || {
        let mut lines = stderr.lines().map_while(Result::ok);
        if let Some(first) = lines.next() {
            let _ = tx.send(first);
        }
        for l in lines {
            eprintln!("[{tag}] {l}");
        }
    });
    let line = match rx.recv_timeout(WAIT) {
        Ok(line) => line,
        Err(e) => {
            let _ = child.kill();
            let status = child.wait();
            panic!("baseline printed no start-up line within {WAIT:?} ({e}; exit {status:?})")
        }
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |w: &str| {
        words
            .iter()
            .position(|x| *x == w)
            .and_then(|at| words.get(at + 2))
            .unwrap_or_else(|| panic!("unexpected start-up line: {line}"))
            .to_string()
    };
    Broker {
        rigs: after("rigs"),
        admin: after("admin"),
        banner: line.clone(),
        child,
    }
}

/// One GET over a fresh connection; the whole response as text. Panics if it takes longer
/// than [`WAIT`], so a hung baseline fails the test instead of stalling it.
pub async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let get = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    tokio::time::timeout(WAIT, get)
        .await
        .unwrap_or_else(|_| panic!("GET {path} on {addr}: no complete answer within {WAIT:?}"))
}
