"""Pydantic models for the structured-output server tests: small, varied schemas a 135M model
completes within a few dozen tokens (strings and arrays bounded)."""

from __future__ import annotations

from enum import Enum
from typing import Literal, Optional, Union
from pydantic import BaseModel, Field

class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)

class Color(BaseModel):
    color: Literal["red", "green", "blue"]

class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)

class Resident(BaseModel):
    name: str = Field(max_length=16)
    address: Address

class Scores(BaseModel):
    scores: list[int] = Field(min_length=1, max_length=3)

class Nickname(BaseModel):
    name: str = Field(max_length=16)
    nickname: Optional[str] = Field(default=None, max_length=10)

class Flag(BaseModel):
    done: bool

class Code(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{3}$")

class Value(BaseModel):
    value: Union[int, bool]

class Size(str, Enum):
    small = "small"
    medium = "medium"
    large = "large"

class Shirt(BaseModel):
    size: Size
    price: int = Field(ge=1, le=100)

class Team(BaseModel):
    members: list[Person] = Field(min_length=1, max_length=2)

class Rating(BaseModel):
    stars: Literal[1, 2, 3, 4, 5]

class Status(BaseModel):
    ok: bool
    level: Literal["low", "high"]

class Pair(BaseModel):
    colors: list[Literal["red", "green", "blue"]] = Field(min_length=2, max_length=2)

class Inner(BaseModel):
    x: int = Field(ge=0, le=9)

class Middle(BaseModel):
    inner: Inner

class Outer(BaseModel):
    middle: Middle

class Constant(BaseModel):
    kind: Literal["point"]
    x: int = Field(ge=-10, le=10)

class Word(BaseModel):
    word: str = Field(min_length=2, max_length=8)

class MaybeAddress(BaseModel):
    address: Optional[Address]

class Temperature(BaseModel):
    celsius: float = Field(ge=-50, le=60)

class Tags(BaseModel):
    tags: list[str] = Field(max_length=2)

class Pet(BaseModel):
    species: Literal["cat", "dog"]
    age: Optional[int] = Field(ge=0, le=30)

class Zip(BaseModel):
    zip: str = Field(pattern=r"^[0-9]{5}$")

# (model, prompt)
MODELS = [
    (Person, "Describe a person."), (Color, "Pick a color."), (Resident, "Describe where someone lives."),
    (Scores, "Give some test scores."), (Nickname, "Describe a person and their nickname."), (Flag, "Is the task done?"),
    (Code, "Give an airport code."), (Value, "Give a value."), (Shirt, "Describe a shirt for sale."),
    (Team, "Describe a small team."), (Rating, "Rate a movie."), (Status, "Report the system status."),
    (Pair, "Pick two colors."), (Outer, "Give a nested value."), (Constant, "Give a point."), (Word, "Say a word."),
    (MaybeAddress, "Give an address if you know one."), (Temperature, "What is the temperature?"),
    (Tags, "Tag this post."), (Pet, "Describe a pet."), (Zip, "Give a US zip code."),
]
