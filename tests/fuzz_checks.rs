//! The fuzz targets' checks (`fuzz/checks/`) under `cargo test`: on every committed seed, and
//! on mutations of them made from a fixed seed (bits flipped, cuts, bytes doubled or inserted,
//! seeds spliced), so that CI runs them without cargo-fuzz or a nightly toolchain. libFuzzer
//! (fuzz/README.md) explores far more; this keeps the checks compiling, true of the seeds, and
//! exercised near them on every run.

mod request_head {
    include!("../fuzz/checks/request_head.rs");
}
mod frame_decoder {
    include!("../fuzz/checks/frame_decoder.rs");
}
mod hello {
    include!("../fuzz/checks/hello.rs");
}
mod admin_request {
    include!("../fuzz/checks/admin_request.rs");
}
mod control_msg {
    include!("../fuzz/checks/control_msg.rs");
}

/// Mutations of each target's seeds per run.
const MUTATIONS: usize = 20_000;

/// xorshift64: the same mutations on every run, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// `seed` changed in one to four places.
fn mutate(seed: &[u8], rng: &mut Rng, all: &[Vec<u8>]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len());
        match rng.below(5) {
            0 if !v.is_empty() => v[at] ^= 1 << rng.below(8),
            1 => v.truncate(at),
            2 if !v.is_empty() => v.insert(at, v[at]),
            3 => {
                let other = &all[rng.below(all.len())];
                v.extend_from_slice(&other[..rng.below(other.len() + 1)]);
            }
            _ => v.insert(at, rng.next() as u8),
        }
    }
    v
}

/// The committed seeds of `target`, in name order.
fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn run(target: &str, check: fn(&[u8])) {
    let seeds = seeds(target);
    assert!(!seeds.is_empty(), "no seeds for {target}");
    for seed in &seeds {
        check(seed);
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ target.len() as u64);
    for i in 0..MUTATIONS {
        let input = mutate(&seeds[i % seeds.len()], &mut rng, &seeds);
        let caught = std::panic::catch_unwind(|| check(&input));
        assert!(caught.is_ok(), "{target}, mutation {i}: {input:?}");
    }
}

#[test]
fn request_head_seeds_and_their_mutations_pass_its_checks() {
    run("request_head", request_head::check);
}

#[test]
fn frame_decoder_seeds_and_their_mutations_pass_its_checks() {
    run("frame_decoder", frame_decoder::check);
}

#[test]
fn hello_seeds_and_their_mutations_pass_its_checks() {
    run("hello", hello::check);
}

#[test]
fn admin_request_seeds_and_their_mutations_pass_its_checks() {
    run("admin_request", admin_request::check);
}

#[test]
fn control_msg_seeds_and_their_mutations_pass_its_checks() {
    run("control_msg", control_msg::check);
}
