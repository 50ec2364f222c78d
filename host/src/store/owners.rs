//! Which node of a Redis Cluster serves which hash slot, as `CLUSTER SLOTS` last said:
//! so the store keeps a breaker per node (one dead master refuses only its own shard's
//! keys) and an error names the node that failed. The `redis` crate keeps its own slot
//! map but does not share it; this one is learnt the same way, in the background, when
//! first asked and again (at most once per [`RELEARN_MS`]) after a failure, a redirect
//! or a refusal, so a promoted replica is learnt within about a second.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::Value;
use tokio::time::Instant;

use super::link::Link;

/// The least time between two refreshes.
const RELEARN_MS: u64 = 1_000;

/// The hash slots of a Redis Cluster.
const SLOTS: u16 = 16_384;

/// The hash slot of `key` (the Redis Cluster spec: CRC16-XMODEM of its hash tag, the
/// text between its first `{` and the next `}` when not empty, else of the whole key).
pub(crate) fn slot(key: &[u8]) -> u16 {
    let tag = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    let mut crc: u16 = 0;
    for &b in tag.unwrap_or(key) {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % SLOTS
}

/// The slots `first..=last` and the address (`host:port`) of the master serving them.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Range {
    first: u16,
    last: u16,
    node: Arc<str>,
}

/// A cluster's slot owners. Shared by a link's clones.
#[derive(Debug)]
pub(crate) struct Owners {
    /// Sorted by slot; empty until the cluster first answered.
    ranges: ArcSwap<Vec<Range>>,
    /// A refresh is under way.
    busy: AtomicBool,
    /// The earliest moment (ms after `origin`) of the next refresh.
    next_ms: AtomicU64,
    origin: Instant,
    /// How long one `CLUSTER SLOTS` may take.
    timeout: Duration,
}

impl Owners {
    pub(crate) fn new(timeout: Duration) -> Self {
        Owners {
            ranges: ArcSwap::from_pointee(Vec::new()),
            busy: AtomicBool::new(false),
            next_ms: AtomicU64::new(0),
            origin: Instant::now(),
            timeout,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The address of the master serving `key`'s slot, as last learnt; `None` before the
    /// cluster first answered (or for a slot it did not list).
    pub(crate) fn of(&self, key: &[u8]) -> Option<Arc<str>> {
        let slot = slot(key);
        let ranges = self.ranges.load();
        let at = ranges.partition_point(|r| r.last < slot);
        ranges.get(at).filter(|r| r.first <= slot).map(|r| r.node.clone())
    }

    /// The masters serving some slot, as last learnt; `None` before the cluster first
    /// answered.
    pub(crate) fn masters(&self) -> Option<Vec<Arc<str>>> {
        let ranges = self.ranges.load();
        if ranges.is_empty() {
            return None;
        }
        let mut masters: Vec<Arc<str>> = ranges.iter().map(|r| r.node.clone()).collect();
        masters.sort();
        masters.dedup();
        Some(masters)
    }

    /// Learns the slot owners again through `link`, in the background, unless a refresh
    /// is under way or the last one was less than [`RELEARN_MS`] ago.
    pub(crate) fn relearn(self: &Arc<Self>, link: &Link) {
        if self.now_ms() < self.next_ms.load(Ordering::Acquire) || self.busy.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.busy.store(false, Ordering::Release);
            return;
        };
        let owners = self.clone();
        let link = link.clone();
        runtime.spawn(async move {
            if let Some(ranges) = ask(&link, owners.timeout).await {
                owners.ranges.store(Arc::new(ranges));
            }
            owners
                .next_ms
                .store(owners.now_ms().saturating_add(RELEARN_MS), Ordering::Release);
            owners.busy.store(false, Ordering::Release);
        });
    }
}

/// The slot owners by `CLUSTER SLOTS`, asked of up to three nodes (the cluster client
/// picks one that is connected each time), each within `timeout`.
async fn ask(link: &Link, timeout: Duration) -> Option<Vec<Range>> {
    let Link::Cluster(conn) = link else {
        return None;
    };
    for _ in 0..3 {
        let mut conn = conn.clone();
        let answer = tokio::time::timeout(
            timeout,
            redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async::<Vec<Vec<Value>>>(&mut conn),
        )
        .await;
        if let Ok(Ok(slots)) = answer
            && let Some(ranges) = parse(&slots)
        {
            return Some(ranges);
        }
    }
    None
}

/// The ranges of a `CLUSTER SLOTS` answer (`[first, last, [host, port, ...], replicas
/// ...]` each), sorted; `None` if it is not one.
fn parse(slots: &[Vec<Value>]) -> Option<Vec<Range>> {
    let int = |v: Option<&Value>| match v {
        Some(Value::Int(i)) => u16::try_from(*i).ok(),
        _ => None,
    };
    let mut ranges = slots
        .iter()
        .map(|range| {
            let Some(Value::Array(master)) = range.get(2) else {
                return None;
            };
            let host = match master.first() {
                Some(Value::BulkString(host)) => String::from_utf8_lossy(host).into_owned(),
                Some(Value::SimpleString(host)) => host.clone(),
                _ => return None,
            };
            Some(Range {
                first: int(range.first())?,
                last: int(range.get(1))?,
                node: format!("{host}:{}", int(master.get(1))?).into(),
            })
        })
        .collect::<Option<Vec<_>>>()?;
    ranges.sort_by_key(|r| r.first);
    Some(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_cluster_specs() {
        // The spec's test vector: CRC16-XMODEM("123456789") = 0x31C3.
        assert_eq!(slot(b"123456789"), 0x31C3 % SLOTS);
        for key in [
            &b"foo"[..],
            b"{user1000}.following",
            b"{user1000}.followers",
            b"foo{}{bar}",
            b"foo{{bar}}zap",
            b"foo{bar}{zap}",
            b"{3:corral:k}:k",
            b"",
        ] {
            let theirs = format!("{:?}", redis::cluster_routing::Slot::for_key(key));
            assert_eq!(
                theirs,
                format!("Slot({})", slot(key)),
                "{:?}",
                String::from_utf8_lossy(key)
            );
        }
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
    }

    #[test]
    fn a_key_is_served_by_the_master_of_its_range() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::Nil,
            ])
        };
        let slots = vec![
            vec![
                Value::Int(5461),
                Value::Int(10922),
                node("10.0.0.2", 7001),
                node("10.0.0.5", 7004),
            ],
            vec![Value::Int(0), Value::Int(5460), node("10.0.0.1", 7000)],
            vec![Value::Int(10923), Value::Int(16383), node("10.0.0.3", 7002)],
        ];
        let owners = Owners::new(Duration::from_secs(1));
        assert_eq!(owners.of(b"foo"), None, "nothing learnt yet");
        owners.ranges.store(Arc::new(parse(&slots).expect("parsed")));
        let at = |key: &[u8]| owners.of(key).map(|n| n.to_string());
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(at(b"foo").as_deref(), Some("10.0.0.3:7002"));
        assert_eq!(slot(b"bar"), 5061);
        assert_eq!(at(b"bar").as_deref(), Some("10.0.0.1:7000"));
        assert_eq!(at(b"123456789").as_deref(), Some("10.0.0.3:7002"));
        assert_eq!(slot(b"hello"), 866);
        assert_eq!(at(b"hello").as_deref(), Some("10.0.0.1:7000"));
        assert_eq!(slot(b"baz"), 4813);
        assert_eq!(slot(b"a"), 15495);
        assert_eq!(at(b"{x}6"), at(b"{x}7"));
        assert_eq!(parse(&[vec![Value::Int(0)]]), None, "not an answer");
    }
}
