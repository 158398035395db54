use clap::Parser;
use fleetlink_loadgen::cli::{Cli, Command};
use fleetlink_loadgen::{fanout, orchestrator, redis_pub};

/// One event-loop thread: the client should be cheap next to the broker it measures; more
/// parallelism comes from `--procs` child processes.
fn main() {
    // A usage error is 64 (EX_USAGE), as for the agent and fleetctl: 2 is this tool's "not
    // all welcomed", and a script must tell a typo from an incomplete ramp.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let _ = e.print();
            std::process::exit(64);
        }
    };
    // The Redis publisher is synchronous: it needs no runtime.
    let cli = match cli.cmd {
        Command::RedisPublish(args) => exit_with(redis_pub::run_publish(args)),
        cmd => Cli { cmd },
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("loadgen: runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = rt.block_on(async move {
        match cli.cmd {
            Command::Rigs(args) => match args.child_slice {
                Some((start, count)) => orchestrator::run_child(args, start, count).await,
                None => orchestrator::run_parent(args).await,
            },
            Command::AdminFanout(args) => fanout::run_fanout(args).await,
            Command::RedisPublish(_) => unreachable!("handled before the runtime"),
        }
    });
    // Don't wait for lingering rig tasks: the report is written, the run is over.
    rt.shutdown_background();
    exit_with(result)
}

fn exit_with(result: anyhow::Result<i32>) -> ! {
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("loadgen: error: {e:#}");
            std::process::exit(1);
        }
    }
}
