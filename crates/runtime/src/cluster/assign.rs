//! Which instance should own a partition: rendezvous (highest-random-weight) hashing.
//!
//! Every member gets a weight per (topic, partition) from a fixed hash of
//! (member, topic, partition); the member with the highest weight is the partition's
//! designated owner. Every instance computes the same answer from the same member list
//! with no coordination, and a change of one member moves only that member's share:
//! adding an n-th instance moves about 1/n of the partitions, all to it; removing one
//! moves exactly its partitions, spread over the others.
//!
//! The hash must never change between versions (instances of two versions would
//! disagree about owners during a rolling upgrade): FNV-1a over a length-prefixed
//! encoding, finished with the splitmix64 mixer. Both are pinned by a test.

/// The designated owner of `(topic, partition)` among `members` (instance ids), or
/// `None` when there are no members. Ties (equal weights) go to the smaller id, so the
/// answer does not depend on the order of `members`.
pub fn owner<'a, S: AsRef<str>>(members: &'a [S], topic: &str, partition: u32) -> Option<&'a str> {
    members
        .iter()
        .map(|m| (weight(m.as_ref(), topic, partition), m.as_ref()))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))
        .map(|(_, m)| m)
}

/// The weight of `member` for `(topic, partition)`.
pub fn weight(member: &str, topic: &str, partition: u32) -> u64 {
    let mut h = Fnv::new();
    h.write_str(member);
    h.write_str(topic);
    h.write(&partition.to_be_bytes());
    mix(h.0)
}

struct Fnv(u64);

impl Fnv {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn new() -> Self {
        Self(Self::OFFSET)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    /// Length first, so ("ab", "c") and ("a", "bc") differ.
    fn write_str(&mut self, s: &str) {
        self.write(&(s.len() as u64).to_be_bytes());
        self.write(s.as_bytes());
    }
}

/// splitmix64's finaliser: spreads FNV's weak low bits over the whole word.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("meshd-{i}")).collect()
    }

    /// Owners of `partitions` partitions of each of `topics` topics.
    fn owners(
        members: &[String],
        topics: usize,
        partitions: u32,
    ) -> BTreeMap<(String, u32), String> {
        let mut out = BTreeMap::new();
        for t in 0..topics {
            let topic = format!("topic-{t}");
            for p in 0..partitions {
                let o = owner(members, &topic, p).expect("members").to_string();
                out.insert((topic.clone(), p), o);
            }
        }
        out
    }

    #[test]
    fn the_hash_is_pinned_across_versions() {
        // Changing these values makes instances of two versions disagree on owners.
        // (Values computed independently of this code.)
        assert_eq!(weight("meshd-0", "orders", 0), 0x696d_10e9_a28f_a9dc);
        assert_eq!(weight("meshd-1", "orders", 7), 0xc4ae_aeb3_e77b_02b9);
        assert_eq!(weight("a", "", u32::MAX), 0xcde0_b62c_78af_8c77);
    }

    #[test]
    fn no_members_no_owner_and_the_order_of_members_does_not_matter() {
        let none: [&str; 0] = [];
        assert_eq!(owner(&none, "t", 0), None);
        let a = ids(5);
        let mut b = a.clone();
        b.reverse();
        assert_eq!(owners(&a, 4, 64), owners(&b, 4, 64));
    }

    #[test]
    fn partitions_spread_evenly() {
        let members = ids(3);
        let o = owners(&members, 8, 128);
        for m in &members {
            let share = o.values().filter(|x| *x == m).count() as f64 / o.len() as f64;
            assert!((0.28..0.39).contains(&share), "{m}: {share}");
        }
    }

    #[test]
    fn adding_a_member_moves_about_one_nth_and_only_to_it() {
        let before = owners(&ids(3), 8, 128);
        let after = owners(&ids(4), 8, 128);
        let moved: Vec<_> = before
            .iter()
            .filter(|(k, v)| after[*k] != **v)
            .map(|(k, _)| after[k].clone())
            .collect();
        assert!(
            moved.iter().all(|m| m == "meshd-3"),
            "moves go to the new member only"
        );
        let share = moved.len() as f64 / before.len() as f64;
        assert!((0.2..0.3).contains(&share), "about 1/4 moved: {share}");
    }

    #[test]
    fn removing_a_member_moves_exactly_its_partitions() {
        let before = owners(&ids(4), 8, 128);
        let survivors: Vec<String> = ids(4).into_iter().filter(|m| m != "meshd-1").collect();
        let after = owners(&survivors, 8, 128);
        for (k, was) in &before {
            if was == "meshd-1" {
                assert_ne!(&after[k], "meshd-1");
            } else {
                assert_eq!(&after[k], was, "{k:?} moved though its owner stayed");
            }
        }
    }
}
