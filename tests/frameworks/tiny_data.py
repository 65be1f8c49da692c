"""A tiny local multimodal SFT dataset in LLaMA-Factory's and ms-swift's formats.

    python tests/frameworks/tiny_data.py OUT_DIR [--n 24] [--seed 0]

Writes
  OUT_DIR/images/img_XXX.png          small RGB PNGs, sizes 28..56 px per side
  OUT_DIR/lf_vlm.json                 LLaMA-Factory sharegpt ("messages" + "images", paths relative to OUT_DIR)
  OUT_DIR/dataset_info.json           LLaMA-Factory dataset registry: dataset name "tiny_vlm"
  OUT_DIR/swift_vlm.jsonl             ms-swift ("messages" + "images", absolute paths)
  OUT_DIR/lf_pref.json                LLaMA-Factory pairwise ("messages" + "chosen" + "rejected" +
                                      "images"): dataset "tiny_pref" (ranking), for dpo and rm
  OUT_DIR/lf_kto.json                 LLaMA-Factory KTO ("messages" + "label", text only): "tiny_kto"
  OUT_DIR/swift_pref.jsonl            ms-swift DPO ("messages" ending in the chosen answer +
                                      "rejected_response" + "images")
Each example has 0..3 images (the user turn carries one "<image>" tag per image) and
answers of uneven length; a preference pair's rejected answer is another of uneven length. Only
the standard library and Pillow are used.
"""

import argparse
import json
import os
import random

from PIL import Image, ImageDraw

SIZES = [(28, 28), (56, 56), (56, 28), (28, 56), (42, 42), (56, 42)]
COLORS = ["red", "green", "blue", "yellow", "white", "black"]
WORDS = (
    "the a tiny model sees one two three red green blue square circle image picture "
    "and of on in with small large left right top bottom color shape count"
).split()


def make_image(path: str, rng: random.Random) -> None:
    w, h = rng.choice(SIZES)
    bg, fg = rng.sample(COLORS, 2)
    img = Image.new("RGB", (w, h), bg)
    d = ImageDraw.Draw(img)
    x0, y0 = rng.randint(0, w // 2), rng.randint(0, h // 2)
    d.rectangle([x0, y0, x0 + w // 3, y0 + h // 3], fill=fg)
    img.save(path, format="PNG")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = os.path.abspath(args.out_dir)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rng = random.Random(args.seed)

    lf_rows, swift_rows, img_id = [], [], 0
    pref_rows, kto_rows, swift_pref = [], [], []
    prng = random.Random(args.seed + 1)  # the preference data's own draws: the SFT data stays as it was
    for i in range(args.n):
        n_img = i % 4  # 0,1,2,3 images, cycling -> uneven numbers within every batch
        rel_paths = []
        for _ in range(n_img):
            rel = f"images/img_{img_id:03d}.png"
            make_image(os.path.join(out, rel), rng)
            rel_paths.append(rel)
            img_id += 1
        q_len = rng.randint(2, 12)
        a_len = rng.randint(1, 40) if i % 3 else rng.randint(40, 80)  # uneven answer lengths
        question = " ".join(rng.choice(WORDS) for _ in range(q_len)) + "?"
        answer = " ".join(rng.choice(WORDS) for _ in range(a_len)) + "."
        user = "<image>" * n_img + question
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        lf_rows.append({"messages": messages, "images": rel_paths})
        swift_rows.append({"messages": messages, "images": [os.path.join(out, p) for p in rel_paths]})
        rejected = " ".join(prng.choice(WORDS) for _ in range(prng.randint(1, 30))) + "."
        pref_rows.append(
            {
                "messages": messages[:1],
                "chosen": messages[1],
                "rejected": {"role": "assistant", "content": rejected},
                "images": rel_paths,
            }
        )
        # KTO text only: LLaMA-Factory 0.9.5's KTO collator drops mm_token_type_ids, which Qwen2-VL's
        # M-RoPE needs for images on transformers 5.6
        text_messages = [{"role": "user", "content": question}, messages[1]]
        kto_rows.append({"messages": text_messages, "label": bool(i % 2), "images": []})
        swift_pref.append(
            {
                "messages": messages,
                "rejected_response": rejected,
                "images": [os.path.join(out, p) for p in rel_paths],
            }
        )

    with open(os.path.join(out, "lf_vlm.json"), "w") as f:
        json.dump(lf_rows, f, indent=1)
    dataset_info = {
        "tiny_vlm": {
            "file_name": "lf_vlm.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
                "system_tag": "system",
            },
        }
    }
    tags = dataset_info["tiny_vlm"]["tags"]
    dataset_info["tiny_pref"] = {
        "file_name": "lf_pref.json",
        "formatting": "sharegpt",
        "ranking": True,
        "tags": tags,
        "columns": {"messages": "messages", "chosen": "chosen", "rejected": "rejected", "images": "images"},
    }
    dataset_info["tiny_kto"] = {
        "file_name": "lf_kto.json",
        "formatting": "sharegpt",
        "tags": tags,
        "columns": {"messages": "messages", "kto_tag": "label", "images": "images"},
    }
    for name, rows in (("lf_pref.json", pref_rows), ("lf_kto.json", kto_rows)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(rows, f, indent=1)
    with open(os.path.join(out, "swift_pref.jsonl"), "w") as f:
        for row in swift_pref:
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(out, "dataset_info.json"), "w") as f:
        json.dump(dataset_info, f, indent=1)
    with open(os.path.join(out, "swift_vlm.jsonl"), "w") as f:
        for row in swift_rows:
            f.write(json.dumps(row) + "\n")
    print(f"{args.n} examples, {img_id} images -> {out}")


if __name__ == "__main__":
    main()
