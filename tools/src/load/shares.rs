//! Splitting a flag's total count among threads so that together they do exactly that total:
//! the first `total % threads` threads take one more than the others (`--messages 5
//! --producers 2` sends 3 and 2, not 2 and 2).

/// Thread `thread`'s share of `total` split among `threads` threads (`threads` > 0).
pub fn share(total: u64, threads: usize, thread: usize) -> u64 {
    let (threads, thread) = (threads as u64, thread as u64);
    total / threads + u64::from(thread < total % threads)
}

/// How much of `total` the threads before `thread` take: where `thread`'s share starts.
pub fn start_of_share(total: u64, threads: usize, thread: usize) -> u64 {
    let (threads, thread) = (threads as u64, thread as u64);
    thread * (total / threads) + thread.min(total % threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shares_add_up_to_the_total_and_follow_each_other() {
        for (total, threads) in [(5, 2), (4, 2), (1, 3), (0, 1), (10, 3), (u64::MAX, 7)] {
            let mut next = 0u64;
            for thread in 0..threads {
                assert_eq!(start_of_share(total, threads, thread), next, "{total} / {threads}");
                next += share(total, threads, thread);
            }
            assert_eq!(next, total, "{total} split among {threads}");
        }
        assert_eq!([share(5, 2, 0), share(5, 2, 1)], [3, 2]);
    }
}
