//! A hint to the CPU, for work on many keys at once.

/// The bytes the CPU caches together.
const LINE: usize = 64;

/// Asks the CPU to bring the memory of `place` (the first `up_to` bytes, at most) into
/// its cache, without waiting for it. A batch that looks up many keys touches each
/// key's memory once, most of it not cached after the batch waited on the network:
/// asked for all first, the misses are waited for together, not one after another. A
/// hint only: it changes no value, and does nothing on a CPU without one.
#[inline(always)]
pub(crate) fn prefetch<T: ?Sized>(place: &T, up_to: usize) {
    let start = std::ptr::from_ref(place).cast::<u8>();
    let len = std::mem::size_of_val(place).min(up_to);
    // One hint per cache line the bytes reach (a line's start: the address rounded down).
    let first = start.addr() & !(LINE - 1);
    let mut line = first;
    while line < start.addr() + len.max(1) {
        prefetch_line(start.with_addr(line));
        line += LINE;
    }
}

#[inline(always)]
fn prefetch_line(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and cannot fault, whatever the
    // address (these are a live reference's lines besides): the raw pointer it takes is
    // never dereferenced. It is a `#[target_feature(enable = "sse")]` function besides,
    // and SSE is in every x86_64 CPU (the target's baseline).
    #[allow(unsafe_code)]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

#[cfg(test)]
mod tests {
    use super::prefetch;

    #[test]
    fn any_place_may_be_hinted() {
        let big = vec![7u8; 10_000];
        prefetch(&big[..], usize::MAX);
        prefetch(&big[3..], 100);
        prefetch(&big[..0], usize::MAX);
        prefetch("a key", 0);
        prefetch(&(), usize::MAX);
        assert_eq!(big[9_999], 7, "a hint changes nothing");
    }
}
