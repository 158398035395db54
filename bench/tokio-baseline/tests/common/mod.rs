//! What every end-to-end test of the baseline starts from: the binary on ephemeral ports.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

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
    let mut stderr = BufReader::new(child.stderr.take().expect("piped stderr"));
    let mut line = String::new();
    stderr.read_line(&mut line).expect("start-up line");
    let tag = tag.to_string();
    std::thread::spawn(move || {
        for l in stderr.lines().map_while(Result::ok) {
            eprintln!("[{tag}] {l}");
        }
    });
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

/// One GET over a fresh connection; the whole response as text.
pub async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}
