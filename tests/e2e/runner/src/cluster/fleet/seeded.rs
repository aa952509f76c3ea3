//! The soak's and the burst's draws, made exactly as bash 5.2 makes `$RANDOM` after
//! `RANDOM=SEED`: the suites drew them in bash before, so a seed names the same plan of events
//! it always named, and a soak's figures stay comparable across the port.

/// bash's `BASH_RAND_MAX`.
const MAX: u32 = 32767;

/// One seeded stream of draws.
pub struct Seeded {
    state: u32,
    /// bash never gives the same value twice in a row (`get_random_number`).
    last: u32,
}

impl Seeded {
    pub fn new(seed: u32) -> Seeded {
        Seeded {
            state: seed,
            last: 0,
        }
    }

    /// A number in `[0, n)`, as `$((RANDOM % n))`.
    pub fn below(&mut self, n: u32) -> u32 {
        self.next() % n.max(1)
    }

    /// The next `$RANDOM`.
    fn next(&mut self) -> u32 {
        loop {
            let value = self.step();
            if value != self.last {
                self.last = value;
                return value;
            }
        }
    }

    /// Park and Miller's minimal standard generator (16807 * x mod 2^31 - 1), its 31 bits
    /// folded to 15 as bash does from compatibility level 51 on.
    fn step(&mut self) -> u32 {
        // bash cannot seed with 0, and takes this seed instead.
        let last = if self.state == 0 {
            123_459_876
        } else {
            self.state
        };
        self.state = ((u64::from(last) * 16807) % 0x7fff_ffff) as u32;
        ((self.state >> 16) ^ (self.state & 0xffff)) & MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_what_bash_gives_after_random_equals_that_seed() {
        // `bash -c 'RANDOM=27; echo $RANDOM ...'` with GNU bash 5.2.15.
        let mut draws = Seeded::new(27);
        let got: Vec<u32> = (0..12).map(|_| draws.next()).collect();
        assert_eq!(
            got,
            [
                27803, 29174, 2472, 31074, 27642, 26532, 12895, 10228, 22406, 27252, 13680, 24095
            ]
        );
        let mut one = Seeded::new(1);
        assert_eq!([one.next(), one.next(), one.next()], [16807, 10791, 19566]);
    }

    #[test]
    fn draws_below_n_are_the_remainders() {
        let mut draws = Seeded::new(27);
        assert_eq!([draws.below(5), draws.below(5), draws.below(5)], [3, 4, 2]);
    }
}
