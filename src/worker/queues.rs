//! A rig's commands between control and its ack, and what they weigh.
//!
//! `--outbox` bounds how many commands a rig may have queued, but a command may be up to 1 MiB
//! (a control message's bound), so counts alone would let one slow rig hold 128 MiB queued and
//! a thousand more written and unacked, and a core's rigs together anything. Bytes are bounded
//! too: per rig, queued ([`RIG_OUTBOX_BYTES`]) and written but unacked
//! ([`RIG_UNACKED_BYTES`]), and per core, all of them together ([`core_command_bytes`]: the
//! broker's [`BROKER_COMMAND_BYTES`] split evenly, so that the bound does not grow with the
//! cores). The core's total is a thread-local: a core is one thread, and its queues never
//! leave it, so the bound costs no shared counter on a command's path.

use std::cell::Cell;
use std::collections::VecDeque;

use std::time::{Duration, Instant};

use crate::ids::Seq;
use crate::registry::msg::{CommandReq, SeqCommand};

/// Queued (not yet written) command bytes one rig may hold; a command past it is refused
/// `rig_unresponsive`, as past `--outbox`.
pub(crate) const RIG_OUTBOX_BYTES: usize = 8 << 20;
/// Written, unacked command bytes kept for one rig's resume; past it the oldest are dropped
/// from resume memory, as past the count.
pub(crate) const RIG_UNACKED_BYTES: usize = 16 << 20;
/// The most command bytes one rig's session holds, queued and unacked: what a resume carries at
/// most (more in Redis are entries whose removal was lost).
pub(crate) const RIG_SESSION_BYTES: usize = RIG_OUTBOX_BYTES + RIG_UNACKED_BYTES;
/// Command bytes the broker's cores hold together for all their rigs; a command past its
/// core's share is refused `overloaded`. A command being written sits in its connection's
/// unsent bytes too (at most 256 KiB past the last frame), which this does not count twice.
pub(crate) const BROKER_COMMAND_BYTES: usize = 2 << 30;

/// One core's share of [`BROKER_COMMAND_BYTES`], and at least one rig's whole session.
pub(crate) fn core_command_bytes(cores: usize) -> usize {
    (BROKER_COMMAND_BYTES / cores.max(1)).max(RIG_SESSION_BYTES)
}
/// Acked commands whose id a rig's queues remember for their `result` event (CONTRACT.md §4:
/// events carry the `id` where it applies). The newest are kept: a rig with more commands
/// acked and running than this has its oldest results reported without their id, joined to
/// their ack by seq instead. Few, since a rig that acks but never reports results keeps them.
pub(crate) const RESULT_IDS: usize = 16;
/// Longest id remembered for a result: an id is whatever control sent (up to a control
/// message's 1 MiB), and these bytes are no longer in the core's count once the command is
/// acked. Ids as control makes them (UUIDs and the like) are far shorter.
pub(crate) const RESULT_ID_MAX: usize = 256;

thread_local! {
    static CORE_BYTES: Cell<usize> = const { Cell::new(0) };
}

/// Command bytes this core's queues hold.
pub(crate) fn core_bytes() -> usize {
    CORE_BYTES.with(Cell::get)
}

fn charge(add: usize, sub: usize) {
    CORE_BYTES.with(|c| c.set((c.get() + add).saturating_sub(sub)));
}

/// Commands in seq order, with their bytes counted here and in the core's total.
#[derive(Default)]
struct Line {
    cmds: VecDeque<SeqCommand>,
    bytes: usize,
}

impl Line {
    fn push(&mut self, cmd: SeqCommand) {
        self.insert(self.cmds.len(), cmd);
    }

    fn insert(&mut self, pos: usize, cmd: SeqCommand) {
        self.bytes += cmd.json.len();
        charge(cmd.json.len(), 0);
        self.cmds.insert(pos, cmd);
    }

    fn remove(&mut self, pos: usize) -> Option<SeqCommand> {
        let cmd = self.cmds.remove(pos)?;
        self.bytes -= cmd.json.len();
        charge(0, cmd.json.len());
        Some(cmd)
    }

    /// The commands, leaving the core's count.
    fn take(&mut self) -> VecDeque<SeqCommand> {
        charge(0, std::mem::take(&mut self.bytes));
        std::mem::take(&mut self.cmds)
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        charge(0, self.bytes);
    }
}

/// A rig's queued and unacked commands.
/// Commands from the rig's offline hold that its outbox could not take yet, in hold order, each
/// with the deadline its hold had. They have no seq until they enter the outbox.
#[derive(Default)]
struct Waiting {
    reqs: VecDeque<(CommandReq, Instant)>,
    bytes: usize,
}

/// What a waiting command weighs against the core's bound: its args, name and id.
pub(crate) fn weight(req: &CommandReq) -> usize {
    req.args.raw().get().len() + req.name.len() + req.id.len()
}

impl Drop for Waiting {
    fn drop(&mut self) {
        charge(0, self.bytes);
    }
}

#[derive(Default)]
pub(crate) struct Queues {
    /// Commands queued, not yet written (bounded by `--outbox` and [`RIG_OUTBOX_BYTES`]).
    outbox: Line,
    /// Commands written, not yet acked: kept for ack latency and for the session's next
    /// connection (bounded; the oldest is dropped and counted beyond it).
    unacked: Line,
    /// Acked commands' ids, for their results (at most [`RESULT_IDS`], oldest first).
    results: VecDeque<(Seq, Box<str>)>,
    /// Commands delivered from the rig's offline hold that wait for room in the outbox.
    waiting: Waiting,
    /// The rig's acknowledged bytes when last looked at, while PINGs wait behind other bytes
    /// ([`crate::worker::slow_reader`]).
    pub(crate) taken_seen: Option<u64>,
    /// Results the rig owes for commands it acked (one per first ack, less the results that
    /// came): each takes an eighth of a `--rig-rate` token, as the acks did, however long the
    /// rig runs its commands; past them a result costs a whole token.
    pub(crate) results_owed: u32,
}

impl Queues {
    /// The queued commands, oldest first.
    pub(crate) fn outbox(&self) -> &VecDeque<SeqCommand> {
        &self.outbox.cmds
    }

    /// The written, unacked commands, oldest first.
    pub(crate) fn unacked(&self) -> &VecDeque<SeqCommand> {
        &self.unacked.cmds
    }

    /// Bytes of the queued commands.
    pub(crate) fn outbox_bytes(&self) -> usize {
        self.outbox.bytes
    }

    /// Bytes of the unacked commands.
    pub(crate) fn unacked_bytes(&self) -> usize {
        self.unacked.bytes
    }

    /// Queues `cmd` last.
    pub(crate) fn push_outbox(&mut self, cmd: SeqCommand) {
        self.outbox.push(cmd);
    }

    /// Queues `cmd`, which Redis already keeps, in seq order: ahead of every command with a
    /// higher seq, and of a held one with the same (this core numbered it too, and Redis
    /// refuses it as stale). Not queued when a command with its seq is queued, not held.
    pub(crate) fn insert_outbox(&mut self, cmd: SeqCommand) {
        let cmds = &self.outbox.cmds;
        if cmds.iter().any(|c| c.seq == cmd.seq && !c.held) {
            return;
        }
        let pos = cmds
            .iter()
            .position(|c| c.seq > cmd.seq || (c.seq == cmd.seq && c.held))
            .unwrap_or(cmds.len());
        self.outbox.insert(pos, cmd);
    }

    /// Takes the oldest queued command.
    pub(crate) fn pop_outbox(&mut self) -> Option<SeqCommand> {
        self.outbox.remove(0)
    }

    /// Removes the queued command at `pos`.
    pub(crate) fn remove_outbox(&mut self, pos: usize) -> Option<SeqCommand> {
        self.outbox.remove(pos)
    }

    /// Releases the held command at `pos` for writing: Redis kept it, or `unkept`, could not.
    pub(crate) fn release(&mut self, pos: usize, unkept: bool) {
        if let Some(cmd) = self.outbox.cmds.get_mut(pos) {
            cmd.held = false;
            cmd.unkept = unkept;
        }
    }

    /// Keeps `cmd` last among the unacked.
    pub(crate) fn push_unacked(&mut self, cmd: SeqCommand) {
        self.unacked.push(cmd);
    }

    /// Takes the oldest unacked command.
    pub(crate) fn pop_unacked(&mut self) -> Option<SeqCommand> {
        self.unacked.remove(0)
    }

    /// Takes unacked command `seq`, wherever it is among them: an ack names one command, and
    /// a rig may ack out of order (the ones it skips stay unacked, for a resume to give back).
    pub(crate) fn take_unacked(&mut self, seq: Seq) -> Option<SeqCommand> {
        let pos = self
            .unacked
            .cmds
            .binary_search_by_key(&seq, |c| c.seq)
            .ok()?;
        self.unacked.remove(pos)
    }

    /// Control's id of the written, unacked command `seq`.
    pub(crate) fn id_of(&self, seq: Seq) -> Option<&str> {
        let cmds = &self.unacked.cmds;
        let pos = cmds.binary_search_by_key(&seq, |c| c.seq).ok()?;
        cmds.get(pos).map(|c| &*c.id)
    }

    /// Remembers the id of acked command `seq` for its result (not one longer than
    /// [`RESULT_ID_MAX`]).
    pub(crate) fn await_result(&mut self, seq: Seq, id: Box<str>) {
        if id.len() > RESULT_ID_MAX {
            return;
        }
        if self.results.len() >= RESULT_IDS {
            self.results.pop_front();
        }
        self.results.push_back((seq, id));
    }

    /// The id for the result of command `seq`: still unacked, or acked and awaiting its
    /// result, which this ends.
    pub(crate) fn result_id(&mut self, seq: Seq) -> Option<Box<str>> {
        if let Some(id) = self.id_of(seq) {
            return Some(id.into());
        }
        let pos = self.results.iter().position(|(s, _)| *s == seq)?;
        self.results.remove(pos).map(|(_, id)| id)
    }

    /// Gives back the room of the command lines once only ids awaiting results are left. A
    /// rig that acks but does not report results (or takes long to) keeps its queues for
    /// those ids, and kept with them the room its last commands took: about 1.3 KB an idle
    /// connection (review bb136). Only then, so that a rig with commands in flight does not
    /// allocate its lines again for every command.
    pub(crate) fn release_lines(&mut self) {
        if self.outbox.cmds.is_empty()
            && self.unacked.cmds.is_empty()
            && self.waiting.reqs.is_empty()
        {
            self.outbox.cmds = VecDeque::new();
            self.unacked.cmds = VecDeque::new();
            self.waiting.reqs = VecDeque::new();
        }
    }

    /// Whether nothing is queued, unacked or awaiting its result.
    pub(crate) fn is_empty(&self) -> bool {
        self.outbox.cmds.is_empty()
            && self.unacked.cmds.is_empty()
            && self.results.is_empty()
            && self.waiting.reqs.is_empty()
    }

    /// Commands from the offline hold waiting for room in the outbox.
    pub(crate) fn waiting_len(&self) -> usize {
        self.waiting.reqs.len()
    }

    /// Puts a command from the offline hold behind those waiting (`front`: back at the head,
    /// where it was taken from). Its hold's time left counts from now.
    pub(crate) fn wait(&mut self, req: CommandReq, front: bool) {
        let left = req.offline_ttl.unwrap_or_default();
        self.wait_until(req, Instant::now() + left, front);
    }

    fn wait_until(&mut self, req: CommandReq, deadline: Instant, front: bool) {
        let w = weight(&req);
        self.waiting.bytes += w;
        charge(w, 0);
        match front {
            true => self.waiting.reqs.push_front((req, deadline)),
            false => self.waiting.reqs.push_back((req, deadline)),
        }
    }

    /// The first waiting command, its time left set to what remains of its hold.
    pub(crate) fn next_waiting(&mut self) -> Option<CommandReq> {
        let (mut req, deadline) = self.waiting.reqs.pop_front()?;
        let w = weight(&req);
        self.waiting.bytes -= w;
        charge(0, w);
        req.offline_ttl = Some(left_of(deadline));
        Some(req)
    }

    /// Every waiting command, for the rig's hold again (the connection closed).
    pub(crate) fn take_waiting(&mut self) -> Vec<CommandReq> {
        std::iter::from_fn(|| self.next_waiting()).collect()
    }

    /// Whether ids of acked commands wait here for their results.
    pub(crate) fn awaits_results(&self) -> bool {
        !self.results.is_empty()
    }

    /// Every command, unacked then queued (seq order), leaving the core's count, and the ids
    /// awaiting results, oldest first.
    pub(crate) fn into_parts(mut self) -> (Vec<SeqCommand>, Vec<(Seq, Box<str>)>) {
        let unacked = self.unacked.take();
        let cmds = unacked.into_iter().chain(self.outbox.take()).collect();
        (cmds, std::mem::take(&mut self.results).into())
    }
}

/// What remains until `deadline`; a hold that ran out keeps a millisecond, so that whoever
/// holds it next reports it expired rather than dropping it.
fn left_of(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_broker_wide_command_bound_is_split_between_cores() {
        assert_eq!(core_command_bytes(1), BROKER_COMMAND_BYTES);
        assert_eq!(core_command_bytes(2), 1 << 30);
        assert_eq!(core_command_bytes(64) * 64, BROKER_COMMAND_BYTES);
        assert_eq!(
            core_command_bytes(1024),
            RIG_SESSION_BYTES,
            "one rig's session fits"
        );
        assert_eq!(core_command_bytes(0), BROKER_COMMAND_BYTES);
    }

    fn cmd(seq: u64, len: usize) -> SeqCommand {
        SeqCommand::for_test(seq, len, false)
    }

    /// Commands another broker gave the rig go in seq order, ahead of this core's held ones
    /// under the same seqs (refused as stale on their way), counted like any other, and not
    /// twice.
    #[test]
    fn a_missed_command_goes_in_seq_order_ahead_of_a_held_one_with_its_seq() {
        let before = core_bytes();
        let mut q = Queues::default();
        q.push_outbox(SeqCommand::for_test(2, 10, true));
        q.push_outbox(SeqCommand::for_test(3, 10, true));
        q.push_outbox(SeqCommand::for_test(5, 10, true));
        q.insert_outbox(cmd(3, 7));
        q.insert_outbox(cmd(2, 7));
        q.insert_outbox(cmd(4, 7));
        q.insert_outbox(cmd(2, 7));
        let order: Vec<(u64, bool)> = q.outbox().iter().map(|c| (c.seq.0, c.held)).collect();
        assert_eq!(
            order,
            [
                (2, false),
                (2, true),
                (3, false),
                (3, true),
                (4, false),
                (5, true)
            ]
        );
        assert_eq!(core_bytes() - before, 51);
    }

    #[test]
    fn bytes_follow_commands_in_and_out_and_leave_the_core_with_the_queues() {
        // Tests share no thread-locals across threads: this one starts at zero.
        let before = core_bytes();
        let mut q = Queues::default();
        q.push_outbox(cmd(1, 100));
        q.push_outbox(cmd(2, 30));
        q.push_outbox(cmd(3, 5));
        assert_eq!((q.outbox_bytes(), core_bytes() - before), (135, 135));
        let first = q.pop_outbox().map(|c| c.seq);
        assert_eq!(first, Some(Seq(1)));
        q.push_unacked(cmd(1, 100));
        assert_eq!((q.outbox_bytes(), q.unacked_bytes()), (35, 100));
        assert_eq!(q.remove_outbox(1).map(|c| c.seq), Some(Seq(3)));
        assert_eq!(core_bytes() - before, 130);
        let mut other = Queues::default();
        other.push_unacked(cmd(9, 1000));
        assert_eq!(core_bytes() - before, 1130);
        let all: Vec<Seq> = q.into_parts().0.into_iter().map(|c| c.seq).collect();
        assert_eq!(all, vec![Seq(1), Seq(2)]);
        assert_eq!(core_bytes() - before, 1000);
        assert_eq!(other.pop_unacked().map(|c| c.seq), Some(Seq(9)));
        other.push_outbox(cmd(10, 7));
        drop(other);
        assert_eq!(core_bytes(), before);
    }

    /// Once only result ids are left, the lines hold no room; with a command in flight they
    /// keep theirs.
    #[test]
    fn lines_give_back_their_room_once_only_result_ids_are_left() {
        let mut q = Queues::default();
        for seq in 1..=3 {
            q.push_outbox(cmd(seq, 10));
        }
        for _ in 1..=3 {
            let c = q.pop_outbox().unwrap();
            q.push_unacked(c);
        }
        for seq in 1..=2 {
            q.pop_unacked();
            q.await_result(Seq(seq), format!("id-{seq}").into());
        }
        q.release_lines();
        assert!(q.unacked().capacity() > 0, "one command is still in flight");
        q.pop_unacked();
        q.await_result(Seq(3), "id-3".into());
        q.release_lines();
        assert_eq!((q.outbox().capacity(), q.unacked().capacity()), (0, 0));
        assert!(!q.is_empty());
        assert_eq!(q.result_id(Seq(2)).as_deref(), Some("id-2"));
    }

    fn held(id: &str, ttl_ms: u64) -> CommandReq {
        CommandReq {
            id: id.into(),
            rig: crate::ids::RigId::parse("r").unwrap(),
            name: "n".into(),
            args: crate::args::Args::empty(),
            reply: crate::registry::msg::ReplyTo::Event,
            offline_ttl: Some(Duration::from_millis(ttl_ms)),
        }
    }

    #[test]
    fn commands_waiting_from_the_hold_keep_their_order_their_time_left_and_their_weight() {
        let before = core_bytes();
        let mut q = Queues::default();
        q.wait(held("a", 60_000), false);
        q.wait(held("b", 60_000), false);
        q.wait(held("gone", 0), false);
        assert_eq!(q.waiting_len(), 3);
        assert!(!q.is_empty(), "waiting commands keep the queues");
        let weighs = core_bytes() - before;
        assert!(weighs >= 3 * 3, "{weighs}");
        let a = q.next_waiting().unwrap();
        assert_eq!(a.id, "a");
        assert!(a.offline_ttl.unwrap() <= Duration::from_millis(60_000));
        q.wait(a, true);
        let rest: Vec<CommandReq> = q.take_waiting();
        let ids: Vec<&str> = rest.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "gone"], "back at the head, in order");
        assert_eq!(
            rest.last().and_then(|r| r.offline_ttl),
            Some(Duration::from_millis(1)),
            "a hold that ran out keeps a millisecond, to be reported expired"
        );
        assert!(q.is_empty());
        assert_eq!(core_bytes(), before);
        q.wait(held("dropped", 10), false);
        drop(q);
        assert_eq!(core_bytes(), before, "dropped with the queues");
    }

    #[test]
    fn an_unacked_commands_id_is_found_by_its_seq() {
        let mut q = Queues::default();
        for seq in [3, 4, 7] {
            q.push_unacked(cmd(seq, 1));
        }
        q.push_outbox(cmd(8, 1));
        let id7 = q.unacked().back().map(|c| c.id.to_string());
        assert_eq!(q.id_of(Seq(7)).map(str::to_string), id7);
        assert!(q.id_of(Seq(7)).is_some());
        // Not written (queued) or not there: no id.
        assert_eq!(q.id_of(Seq(8)), None);
        assert_eq!(q.id_of(Seq(5)), None);
    }

    #[test]
    fn an_acked_commands_id_waits_for_its_result_and_only_the_newest_wait() {
        let mut q = Queues::default();
        q.push_unacked(cmd(1, 1));
        let id1 = q.unacked().front().map(|c| c.id.clone()).expect("id");
        assert_eq!(
            q.result_id(Seq(1)),
            Some(id1.clone()),
            "unacked: its own id"
        );
        let acked = q.pop_unacked().expect("acked");
        q.await_result(acked.seq, acked.id);
        assert!(!q.is_empty(), "held for its result");
        assert_eq!(q.result_id(Seq(1)), Some(id1));
        assert!(q.is_empty(), "the result ends it");
        assert_eq!(q.result_id(Seq(1)), None, "once");
        for seq in 2..2 + RESULT_IDS as u64 + 3 {
            q.await_result(Seq(seq), format!("c{seq}").into());
        }
        assert_eq!(q.result_id(Seq(4)), None, "the oldest went");
        assert_eq!(q.result_id(Seq(5)).as_deref(), Some("c5"));
        q.await_result(Seq(99), "x".repeat(RESULT_ID_MAX + 1).into());
        assert_eq!(q.result_id(Seq(99)), None, "too long to keep");
    }
}
