"""Writes a ratings file in MovieLens' format (ml-latest's ratings.csv: a header, then
`userId,movieId,rating,timestamp`, ratings 0.5 to 5.0 in half stars, unix seconds, sorted by user
then time), for following docs/sequences.md's MovieLens guide without the download:

    python tools/movielens_sample.py --output ratings.csv [--users 600] [--movies 3000] [--ratings 100000] [--seed 0]

Each movie belongs to one of 20 genres; each user's taste drifts from one genre to the next over
its ratings, and 60% of them are of its current taste. A rating is high when the movie is of that
taste (which the user's last ratings show, and its id alone does not), plus a per-movie quality
and noise.
"""
import argparse
import csv

import numpy as np

GENRES, START = 20, 1_500_000_000


def ratings(users: int, movies: int, count: int, seed: int):
    """(userId, movieId, rating, timestamp) rows, sorted by user then time."""
    rng = np.random.default_rng(seed)
    genre = rng.integers(0, GENRES, movies)
    by_genre = [np.flatnonzero(genre == g) for g in range(GENRES)]
    quality = rng.normal(0, 0.5, movies)
    per_user = rng.multinomial(count - 5 * users, np.ones(users) / users) + 5
    rows = []
    for user, n in enumerate(per_user, start=1):
        taste = rng.integers(0, GENRES)
        time = START + int(rng.integers(0, 86_400 * 365))
        for _ in range(n):
            if rng.random() < 0.03:   # the taste moves on
                taste = (taste + 1) % GENRES
            g = taste if rng.random() < 0.6 else int(rng.integers(0, GENRES))
            movie = int(rng.choice(by_genre[g])) if len(by_genre[g]) else int(rng.integers(0, movies))
            score = 2.5 + (1.5 if g == taste else -0.5) + quality[movie] + rng.normal(0, 0.7)
            rows.append((user, movie + 1, float(np.clip(np.round(score * 2) / 2, 0.5, 5.0)), time))
            time += int(rng.integers(1, 86_400))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--users", type=int, default=600)
    ap.add_argument("--movies", type=int, default=3000)
    ap.add_argument("--ratings", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.ratings < 5 * args.users:
        ap.error(f"--ratings {args.ratings}: at least 5 a user ({5 * args.users})")
    with open(args.output, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["userId", "movieId", "rating", "timestamp"])
        out.writerows(ratings(args.users, args.movies, args.ratings, args.seed))


if __name__ == "__main__":
    main()
