//! What a process knows of its prefix's generation (contract §7.5), and the rules that
//! keep it right under late, lost and overlapping news.
//!
//! Every entry is named in its prefix's generation ([`crate::tags`]: `clear` moves it
//! on). A process reads the generation from the store, keeps it for an L1 TTL, and hears
//! of clears on the invalidation channel. What it knows is one [`Known`] value; a body
//! keeps it and changes it only through [`Known::hear`], with `now` and what happened
//! passed in:
//!
//! - a **read** that overlapped a clear this process heard gives way to what the clear
//!   set (the later of the two: an announcement may come late); one that overlapped a
//!   **gap** (announcements may have been missed), or another read that was kept (the
//!   replies may have crossed), is used for its call and not kept;
//! - this process's **own clear** is trusted, unless another clear was heard (or a gap
//!   happened) while it was written (that one may be newer): then it is read again;
//! - an **announced** clear moves the generation forward, trusted no longer than the
//!   last read (an announcement may be late, a later one lost); a repeated one is no news;
//!   an older one means the counter went back (a store restart), a gap;
//! - a generation **stands in** for one that cannot be read ([`Known::fallback`]) only
//!   if it was read (or written) since the last gap: else a clear may have been missed,
//!   and entries named in it must not be read;
//! - a wall clock **stepped back** ([`stepped_back`]) is a gap too: what was kept until
//!   a wall-clock moment would be kept for as long again as the step.

/// The clears and the gaps in the announcements a process heard, each counted: taken
/// ([`Known::heard`]) before a read of the generation, and handed back with what it read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Heard {
    /// Clears (this process's own, or announced) that set the generation.
    pub clears: u64,
    /// Times what is known went stale: a gap in the subscription (announcements may
    /// have been missed), a clear announced below the known generation.
    pub gaps: u64,
    /// Reads of the generation kept. Two reads on their way at once may be answered in
    /// either order: one that began before another was kept may be the older, and is
    /// used for its own call only.
    pub reads: u64,
}

impl Heard {
    /// Whether no clear and no gap was heard between `since` (taken before) and this.
    #[must_use]
    pub fn no_news_since(&self, since: &Heard) -> bool {
        self.clears == since.clears && self.gaps == since.gaps
    }
}

/// What a process knows of its prefix's generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Known {
    /// The generation as last known (0: never cleared, or never read).
    pub generation: u64,
    /// Until when (Unix ms) it may be used without reading it (0: read it first).
    pub until_ms: u64,
    /// Whether it may stand in for the store's when a read of it fails: it was read
    /// (or written) since the last gap, and every clear since was heard.
    pub trusted: bool,
    /// What was heard so far.
    pub heard: Heard,
    /// Whether the process's L1 holds entries judged in `generation`, so that a kept
    /// read of another one flushes it: true from the start for a process whose L1 is its
    /// own (empty then); false for a component instance until it learns one, since its
    /// L1 is shared with instances that each know their own.
    pub judges_l1: bool,
}

/// What happened, for [`Known::hear`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum News {
    /// The store held `generation`, read after [`Known::heard`] said `since`; kept (if
    /// nothing was heard meanwhile) until `until_ms` ([`crate::tags::known_until`]).
    Read {
        /// What was heard when the read began.
        since: Heard,
        /// What the store held.
        generation: u64,
        /// Until when it may be kept.
        until_ms: u64,
    },
    /// This process's own clear wrote `generation`, its write having begun when
    /// [`Known::heard`] said `since`.
    OwnClear {
        /// What was heard when the write began.
        since: Heard,
        /// What it wrote.
        generation: u64,
        /// Until when it may be kept.
        until_ms: u64,
    },
    /// Another process announced a clear that set `generation`.
    Announced {
        /// What the announcement says.
        generation: u64,
        /// Until when it may be kept.
        until_ms: u64,
    },
    /// Announcements may have been missed (the subscription was re-established).
    Gap,
}

/// What [`Known::hear`] leaves the caller to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heeded {
    /// The generation the caller's call uses now (for a read: what it read, or what a
    /// clear heard meanwhile set, whichever is later).
    pub generation: u64,
    /// Whether L1 holds entries named in another generation: it must be flushed.
    pub flush_l1: bool,
}

impl Known {
    /// What a process whose L1 is its own knows at its start: nothing read, and
    /// generation 0 for an L1 that is empty.
    #[must_use]
    pub fn in_process() -> Known {
        Known {
            judges_l1: true,
            ..Known::in_instance()
        }
    }

    /// What a component instance knows at its start: nothing, and nothing of the L1 it
    /// shares with other instances.
    #[must_use]
    pub const fn in_instance() -> Known {
        Known {
            generation: 0,
            until_ms: 0,
            trusted: false,
            heard: Heard {
                clears: 0,
                gaps: 0,
                reads: 0,
            },
            judges_l1: false,
        }
    }

    /// What was heard so far: taken before a read of the generation or a clear.
    #[must_use]
    pub fn heard(&self) -> Heard {
        self.heard
    }

    /// The generation, if it may be used at `now_ms` without reading it.
    #[must_use]
    pub fn usable(&self, now_ms: u64) -> Option<u64> {
        (now_ms < self.until_ms).then_some(self.generation)
    }

    /// The generation that may stand in for the store's when a read of it fails: the
    /// one last known, if it was read (or written) since the last gap; else `None`
    /// (never read, or a clear may have been missed since), and entries named in it are
    /// not to be read: an entry a clear left would be served.
    #[must_use]
    pub fn fallback(&self) -> Option<u64> {
        self.trusted.then_some(self.generation)
    }

    /// Takes in `news`, and says which generation the caller uses and whether L1 must
    /// be flushed.
    pub fn hear(&mut self, news: News) -> Heeded {
        match news {
            News::Read {
                since,
                generation,
                until_ms,
            } => self.read(since, generation, until_ms),
            News::OwnClear {
                since,
                generation,
                until_ms,
            } => {
                // A clear heard (or perhaps missed, in a gap) while this one was
                // written may be newer than it: read the store's next time. (What the
                // store held is kept as it is, lower than the known one or not.)
                let trusted = self.heard == since;
                self.heard.clears += 1;
                self.generation = generation;
                self.until_ms = if trusted { until_ms } else { 0 };
                self.trusted = trusted;
                self.judges_l1 = true;
                self.heeded(true)
            }
            News::Announced { generation, until_ms } => self.announced(generation, until_ms),
            News::Gap => {
                self.heard.gaps += 1;
                self.until_ms = 0;
                self.trusted = false;
                self.heeded(true)
            }
        }
    }

    fn read(&mut self, since: Heard, generation: u64, until_ms: u64) -> Heeded {
        if self.heard.clears != since.clears {
            // What the clear set is newer than what the read may have seen, unless its
            // announcement came late: the later of the two, for this call only.
            return Heeded {
                generation: self.generation.max(generation),
                flush_l1: false,
            };
        }
        if self.heard.gaps != since.gaps || self.heard.reads != since.reads {
            // After a gap: newer than anything known, and perhaps older than what was
            // missed. After another read was kept: perhaps older than that one (their
            // replies crossed), and a store that restarted empty is believed, so a
            // lower generation would stand. Either way good for this call (a clear
            // that ended before it began is in it), not kept.
            return Heeded {
                generation,
                flush_l1: false,
            };
        }
        self.heard.reads += 1;
        // Not a maximum: a store that restarted empty counts from 0 again, and every
        // process must agree with it.
        let before = std::mem::replace(&mut self.generation, generation);
        self.until_ms = until_ms;
        self.trusted = true;
        // Another process cleared (or the counter was lost): L1 was judged by the
        // names of another generation.
        let flush_l1 = self.judges_l1 && before != generation;
        self.judges_l1 = true;
        self.heeded(flush_l1)
    }

    /// Newer than what is known: it moves there, kept no longer than what is known was
    /// (a read's bound, or `until_ms` if sooner; none after a gap, in which a newer clear
    /// may have been missed too: the next call reads it). The known one again (a late or repeated announcement): no news. Older:
    /// the counter went back (a store restart emptied it, and a clear counted from
    /// there), so what is known is stale and the next call reads it again: a gap.
    fn announced(&mut self, generation: u64, until_ms: u64) -> Heeded {
        let news = generation != self.generation;
        if generation > self.generation {
            self.heard.clears += 1;
            self.generation = generation;
            // Trusted no longer than the last read said: an announcement may come late
            // (its clear retried it), and a later clear whose announcement was lost may
            // have moved the store past it since. Only a read restarts the L1 TTL.
            self.until_ms = self.until_ms.min(until_ms);
        } else if generation < self.generation {
            self.heard.gaps += 1;
            self.until_ms = 0;
            self.trusted = false;
        }
        self.heeded(news)
    }

    fn heeded(&self, flush_l1: bool) -> Heeded {
        Heeded {
            generation: self.generation,
            flush_l1,
        }
    }
}

/// How far behind the latest reading a body saw its wall clock may read before the
/// body takes it for a step back: readings taken on two threads and compared in the
/// other order are not a step.
pub const CLOCK_STEP_MS: u64 = 1_000;

/// Whether a reading of `now_ms`, after `latest_ms` (the latest reading the body saw),
/// is a step back of the wall clock. A body keeps what it knows until wall-clock moments
/// (the generation, a tag's moments, an L1 copy): after a step back they all lie further
/// away by the step, and without announcements a process would learn of a clear that
/// much later than the L1 TTL it promises. So a body takes a step back as a gap in the
/// announcements ([`News::Gap`]): L1 flushed, the generation and the tags read again.
#[must_use]
pub fn stepped_back(latest_ms: u64, now_ms: u64) -> bool {
    now_ms.saturating_add(CLOCK_STEP_MS) < latest_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNTIL: u64 = 10_000;

    #[test]
    fn a_clock_read_more_than_a_second_behind_the_latest_reading_stepped_back() {
        assert!(!stepped_back(10_000, 10_000));
        assert!(!stepped_back(10_000, 20_000), "forward");
        assert!(!stepped_back(10_000, 9_000), "two threads' readings, crossed");
        assert!(stepped_back(10_000, 8_999));
        assert!(stepped_back(u64::MAX, 0));
        assert!(!stepped_back(0, u64::MAX));
    }

    /// A read of `generation` that began when `since` was heard (`None`: nothing heard
    /// while it was on its way).
    fn read(known: &mut Known, since: impl Into<Option<Heard>>, generation: u64) -> Heeded {
        let since = since.into().unwrap_or(known.heard());
        known.hear(News::Read {
            since,
            generation,
            until_ms: UNTIL,
        })
    }

    fn announced(known: &mut Known, generation: u64) -> Heeded {
        known.hear(News::Announced {
            generation,
            until_ms: UNTIL,
        })
    }

    fn own_clear(known: &mut Known, since: impl Into<Option<Heard>>, generation: u64) -> Heeded {
        let since = since.into().unwrap_or(known.heard());
        known.hear(News::OwnClear {
            since,
            generation,
            until_ms: UNTIL,
        })
    }

    /// A process that read `generation` once and heard nothing since.
    fn read_once(generation: u64) -> Known {
        let mut known = Known::in_process();
        read(&mut known, None, generation);
        known
    }

    #[test]
    fn a_clear_heard_below_the_known_generation_makes_it_read_again() {
        let mut known = read_once(1_700_000_000_000);
        assert!(announced(&mut known, 1_700_000_000_500).flush_l1);
        assert_eq!(known.usable(0), Some(1_700_000_000_500), "kept");
        // A store restart emptied the counter, and a clock behind ours cleared from there.
        assert!(announced(&mut known, 1_700_000_000_100).flush_l1);
        assert_eq!(known.usable(0), None, "the known generation is stale: read again");
        // This cache's own clear is what the store holds, lower or not.
        let heeded = own_clear(&mut known, None, 1_700_000_000_050);
        assert_eq!(heeded.generation, 1_700_000_000_050);
        assert!(heeded.flush_l1);
        assert_eq!(known.until_ms, UNTIL);
    }

    #[test]
    fn a_read_answered_after_a_later_one_was_kept_is_not_kept() {
        let mut known = read_once(0);
        let slow = known.heard();
        // Another read begins later, sees the clear to ...500 and is answered first.
        let quick = known.heard();
        read(&mut known, quick, 1_700_000_000_500);
        // The slow read was applied before the clear: good for its own call only.
        let heeded = read(&mut known, slow, 0);
        assert_eq!(heeded.generation, 0);
        assert!(!heeded.flush_l1);
        assert_eq!(known.usable(0), Some(1_700_000_000_500), "the later read stands");
        // A read begun after both is kept.
        let next = known.heard();
        read(&mut known, next, 1_700_000_000_900);
        assert_eq!(known.usable(0), Some(1_700_000_000_900));
    }

    #[test]
    fn a_late_announcement_never_extends_what_a_read_trusted() {
        let mut known = Known::in_process();
        known.hear(News::Read {
            since: known.heard(),
            generation: 0,
            until_ms: 3_000,
        });
        // A clear to ...1_011 whose announcement never came; then, past the read's
        // bound, the late announcement of an older clear (...135, retried).
        let heeded = known.hear(News::Announced {
            generation: 1_700_000_000_135,
            until_ms: 7_000,
        });
        assert!(heeded.flush_l1);
        assert_eq!(known.generation, 1_700_000_000_135);
        assert_eq!(
            known.usable(4_000),
            None,
            "past the read's bound the store is read again, where the later clear is"
        );
        assert_eq!(
            known.usable(2_000),
            Some(1_700_000_000_135),
            "within it: moved on"
        );
    }

    #[test]
    fn an_announcement_after_a_gap_moves_the_generation_but_is_not_trusted() {
        let mut known = read_once(1_700_000_000_000);
        // The subscription dropped; a clear to ...900 was missed; an older clear's
        // announcement, retried in the background, arrives after the resubscription.
        known.hear(News::Gap);
        assert!(announced(&mut known, 1_700_000_000_500).flush_l1);
        assert_eq!(known.generation, 1_700_000_000_500);
        assert_eq!(
            known.usable(0),
            None,
            "a newer clear may have been missed in the gap: read again"
        );
    }

    #[test]
    fn a_repeated_announcement_is_no_news() {
        let mut known = read_once(1_700_000_000_000);
        let before = known.heard();
        assert!(!announced(&mut known, 1_700_000_000_000).flush_l1, "no L1 flush");
        assert_eq!(known.heard(), before, "a read on its way is still kept");
    }

    #[test]
    fn an_own_clear_that_overlapped_another_is_read_again() {
        let mut known = read_once(1_700_000_000_000);
        // This cache's clear begins; another process's newer clear is heard before its
        // own write's answer is.
        let since = known.heard();
        announced(&mut known, 1_700_000_000_900);
        own_clear(&mut known, since, 1_700_000_000_500);
        assert_eq!(
            known.usable(0),
            None,
            "the other clear may be the later one: read again"
        );
        assert_eq!(known.fallback(), None);
    }

    #[test]
    fn an_own_clear_across_a_gap_is_read_again() {
        let mut known = read_once(1_700_000_000_000);
        let since = known.heard();
        known.hear(News::Gap);
        own_clear(&mut known, since, 1_700_000_000_500);
        assert_eq!(
            known.usable(0),
            None,
            "a clear missed in the gap may be the later one"
        );
        assert_eq!(known.generation, 1_700_000_000_500, "for the calls until then");
    }

    #[test]
    fn a_read_that_saw_a_later_clear_than_one_announced_meanwhile_uses_the_later() {
        let mut known = read_once(1_700_000_000_000);
        let since = known.heard();
        // A late announcement of an older clear, while the read saw a later one.
        announced(&mut known, 1_700_000_000_500);
        let heeded = read(&mut known, since, 1_700_000_000_900);
        assert_eq!(heeded.generation, 1_700_000_000_900);
        assert!(!heeded.flush_l1, "the announcement flushed L1 already");
        assert_eq!(known.generation, 1_700_000_000_500, "for the call only");
    }

    #[test]
    fn a_read_overlapping_a_gap_is_used_once_and_one_overlapping_a_clear_gives_way() {
        let mut known = Known::in_process();
        // The subscription came up (a gap) while a fresh process read the generation.
        let since = known.heard();
        known.hear(News::Gap);
        let heeded = read(&mut known, since, 1_700_000_000_500);
        assert_eq!(
            heeded.generation, 1_700_000_000_500,
            "newer than what is known: used"
        );
        assert_eq!(known.generation, 0, "not kept");
        assert_eq!(known.usable(0), None, "read again next time");
        // A clear heard while a read was on its way set a newer one.
        let since = known.heard();
        announced(&mut known, 1_700_000_000_700);
        assert_eq!(
            read(&mut known, since, 1_700_000_000_500).generation,
            1_700_000_000_700
        );
        // Nothing heard meanwhile: kept, and L1 (named in ...700) flushed.
        let since = known.heard();
        let heeded = read(&mut known, since, 1_700_000_000_900);
        assert_eq!(heeded.generation, 1_700_000_000_900);
        assert!(heeded.flush_l1);
        assert_eq!(known.usable(UNTIL - 1), Some(1_700_000_000_900));
        assert_eq!(known.usable(UNTIL), None, "kept until the L1 TTL");
        // Read again, unchanged: L1 stays.
        assert!(!read(&mut known, None, 1_700_000_000_900).flush_l1);
    }

    #[test]
    fn an_instance_flushes_its_shared_l1_only_once_it_knew_a_generation() {
        let mut known = Known::in_instance();
        assert!(
            !read(&mut known, None, 1_700_000_000_500).flush_l1,
            "the shared L1 was judged by other instances"
        );
        assert!(
            read(&mut known, None, 1_700_000_000_900).flush_l1,
            "another process cleared"
        );
        let mut own = Known::in_process();
        assert!(
            read(&mut own, None, 1_700_000_000_500).flush_l1,
            "not judged in 0"
        );
    }

    #[test]
    fn only_a_generation_read_since_the_last_gap_stands_in_for_an_unread_one() {
        let mut known = Known::in_process();
        assert_eq!(
            known.fallback(),
            None,
            "never read: a clear may have left entries under 0"
        );
        read(&mut known, None, 1_700_000_000_000);
        assert_eq!(known.fallback(), Some(1_700_000_000_000));
        announced(&mut known, 1_700_000_000_500);
        assert_eq!(
            known.fallback(),
            Some(1_700_000_000_500),
            "every clear since was heard"
        );
        known.hear(News::Gap);
        assert_eq!(known.fallback(), None, "a clear may have been missed in the gap");
        own_clear(&mut known, None, 1_700_000_000_900);
        assert_eq!(known.fallback(), Some(1_700_000_000_900));
    }
}
