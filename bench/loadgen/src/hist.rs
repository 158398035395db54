//! A small log-linear histogram (≤ 0.8 % relative error) that serialises sparsely, so children can
//! ship theirs to the parent as JSON and the parent can merge them exactly.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Values below this are exact; above, each power of two is split into this many buckets.
const SUB: u64 = 128;
const SUB_BITS: u32 = 7;

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Histogram {
    /// bucket index -> count (sparse; typically a few hundred entries). Serialised as pairs:
    /// integer map keys do not survive serde's buffering of internally tagged enums.
    #[serde(with = "pairs")]
    counts: BTreeMap<u32, u64>,
    count: u64,
    sum: u64,
    min: u64,
    max: u64,
}

/// Percentiles as they appear in reports; all `None` when no value was recorded.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub count: u64,
    pub min: Option<u64>,
    pub mean: Option<f64>,
    pub p50: Option<u64>,
    pub p90: Option<u64>,
    pub p99: Option<u64>,
    pub p999: Option<u64>,
    pub max: Option<u64>,
    /// The distribution for plots: `[fraction, value]` at every percentile 1–99, then 99.5,
    /// 99.9 and 1.0 (the max); empty when no value was recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cdf: Vec<(f64, u64)>,
}

/// The cumulative fractions a summary's `cdf` is given at.
pub fn cdf_fractions() -> impl Iterator<Item = f64> {
    (1..100)
        .map(|p| f64::from(p) / 100.0)
        .chain([0.995, 0.999, 1.0])
}

mod pairs {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(m: &BTreeMap<u32, u64>, s: S) -> Result<S::Ok, S::Error> {
        m.iter()
            .map(|(&k, &v)| (k, v))
            .collect::<Vec<_>>()
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<u32, u64>, D::Error> {
        Ok(Vec::<(u32, u64)>::deserialize(d)?.into_iter().collect())
    }
}

fn index(v: u64) -> u32 {
    if v < SUB {
        return v as u32;
    }
    let e = 63 - v.leading_zeros(); // >= SUB_BITS
    let m = (v >> (e - SUB_BITS)) & (SUB - 1);
    (SUB + u64::from(e - SUB_BITS) * SUB + m) as u32
}

/// The middle of the value range a bucket covers.
fn value_of(idx: u32) -> u64 {
    let idx = u64::from(idx);
    if idx < SUB {
        return idx;
    }
    let shift = (idx - SUB) / SUB;
    let m = (idx - SUB) % SUB;
    let lo = (SUB + m) << shift;
    lo + ((1u64 << shift) >> 1)
}

impl Histogram {
    pub fn record(&mut self, v: u64) {
        *self.counts.entry(index(v)).or_insert(0) += 1;
        if self.count == 0 || v < self.min {
            self.min = v;
        }
        self.max = self.max.max(v);
        self.count += 1;
        self.sum = self.sum.saturating_add(v);
    }

    pub fn merge(&mut self, other: &Histogram) {
        if other.count == 0 {
            return;
        }
        for (&k, &c) in &other.counts {
            *self.counts.entry(k).or_insert(0) += c;
        }
        if self.count == 0 || other.min < self.min {
            self.min = other.min;
        }
        self.max = self.max.max(other.max);
        self.count += other.count;
        self.sum = self.sum.saturating_add(other.sum);
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// The value at quantile `q` (0..=1), clamped to the exact min/max.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (&k, &c) in &self.counts {
            seen += c;
            if seen >= rank {
                return Some(value_of(k).clamp(self.min, self.max));
            }
        }
        Some(self.max)
    }

    pub fn summary(&self) -> Summary {
        let some = self.count > 0;
        Summary {
            count: self.count,
            min: some.then_some(self.min),
            mean: some.then(|| self.sum as f64 / self.count as f64),
            p50: self.quantile(0.50),
            p90: self.quantile(0.90),
            p99: self.quantile(0.99),
            p999: self.quantile(0.999),
            max: some.then_some(self.max),
            cdf: cdf_fractions()
                .filter_map(|q| Some((q, self.quantile(q)?)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_for_small_values() {
        let mut h = Histogram::default();
        for v in 1..=100 {
            h.record(v);
        }
        assert_eq!(h.quantile(0.5), Some(50));
        assert_eq!(h.quantile(0.99), Some(99));
        assert_eq!(h.quantile(1.0), Some(100));
        assert_eq!(h.summary().min, Some(1));
    }

    #[test]
    fn the_cdf_rises_through_every_percentile_to_the_max() {
        let mut h = Histogram::default();
        assert!(h.summary().cdf.is_empty());
        for v in 1..=1000 {
            h.record(v);
        }
        let cdf = h.summary().cdf;
        assert_eq!(cdf.len(), 102);
        assert_eq!(cdf.first().map(|p| p.0), Some(0.01));
        assert_eq!(cdf.last(), Some(&(1.0, 1000)));
        assert!(cdf.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
        let at = |q: f64| cdf.iter().find(|p| p.0 == q).map(|p| p.1);
        // Within the histogram's 0.8 % of the exact value.
        assert!(at(0.5).is_some_and(|v| v.abs_diff(500) <= 4));
        assert!(at(0.99).is_some_and(|v| v.abs_diff(990) <= 8));
    }

    #[test]
    fn relative_error_is_small() {
        for v in [128u64, 1000, 12_345, 999_999, 123_456_789, u64::MAX / 3] {
            let got = value_of(index(v));
            let err = (got as f64 - v as f64).abs() / v as f64;
            assert!(err < 0.008, "{v} -> {got} ({err})");
        }
    }

    #[test]
    fn merge_equals_recording_everything() {
        let (mut a, mut b, mut all) = (
            Histogram::default(),
            Histogram::default(),
            Histogram::default(),
        );
        for v in 0..5000u64 {
            let x = v * 37 % 100_000;
            if v % 2 == 0 {
                a.record(x)
            } else {
                b.record(x)
            }
            all.record(x);
        }
        a.merge(&b);
        assert_eq!(a, all);
        let json = serde_json::to_string(&a).unwrap();
        let back: Histogram = serde_json::from_str(&json).unwrap();
        assert_eq!(back.summary(), all.summary());
    }

    #[test]
    fn empty_summary() {
        let s = Histogram::default().summary();
        assert_eq!(s.count, 0);
        assert_eq!(s.p99, None);
    }
}
