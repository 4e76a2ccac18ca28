"""Text for tools/bench_quant.py, written for it. Evaluation and calibration sets do not overlap."""

# 60 varied sentences: the MiniLM evaluation set.
EVAL_SENTENCES = [
    "The cat slept on the warm windowsill all afternoon.",
    "Interest rates rose for the third time this year, unsettling bond markets.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Could you send me the quarterly report by Friday?",
    "The striker scored twice in the final ten minutes to win the cup.",
    "Heavy rain is expected across the northern valleys tomorrow morning.",
    "She learned to play the cello at the age of forty.",
    "The compiler rejected the program because of a missing semicolon.",
    "Our flight was delayed by four hours due to a mechanical fault.",
    "Mix the flour and butter until the dough resembles breadcrumbs.",
    "The museum's new wing displays sculptures from ancient Greece.",
    "A black hole forms when a massive star collapses under its own gravity.",
    "He apologized for forgetting their anniversary and booked a dinner.",
    "The committee voted to postpone the decision until next spring.",
    "Regular exercise lowers the risk of heart disease and diabetes.",
    "The library will be closed on public holidays.",
    "Vaccines train the immune system to recognize specific pathogens.",
    "My grandmother grew tomatoes, beans and zucchini in her garden.",
    "The startup raised twelve million dollars in its first funding round.",
    "Glaciers in the Alps have lost a third of their volume since 1990.",
    "Please restart the router if the connection drops again.",
    "The novel follows a family of fishermen over three generations.",
    "Sound travels faster in water than in air.",
    "The judge dismissed the case for lack of evidence.",
    "Add a pinch of salt and stir the soup gently.",
    "Thousands of fans queued overnight for concert tickets.",
    "The new policy requires employees to change passwords every ninety days.",
    "Owls can rotate their heads by as much as 270 degrees.",
    "The bridge was closed after engineers found cracks in its supports.",
    "I prefer tea in the morning and coffee after lunch.",
    "Electric cars are becoming cheaper as battery costs fall.",
    "The orchestra rehearsed the symphony for six weeks before the premiere.",
    "Children under twelve must be accompanied by an adult.",
    "The spacecraft entered orbit around Jupiter after a five-year journey.",
    "He fixed the leaking tap with a new rubber washer.",
    "The city council approved funding for a new bicycle lane network.",
    "Most mammals have seven vertebrae in their necks, including giraffes.",
    "The exam covers algebra, geometry and basic probability.",
    "A sudden frost destroyed much of the vineyard's harvest.",
    "The detective noticed that the clock in the hallway had stopped.",
    "Machine translation has improved dramatically over the last decade.",
    "We hiked to the summit and watched the sunrise over the lake.",
    "The bakery on the corner sells the best croissants in town.",
    "Inflation erodes the purchasing power of savings held in cash.",
    "The patient was discharged after a week of observation.",
    "Bees communicate the location of flowers through a waggle dance.",
    "The software update fixes several security vulnerabilities.",
    "Their wedding took place in a small chapel by the sea.",
    "The river burst its banks, flooding hundreds of homes.",
    "Learning a second language can improve memory and attention.",
    "The printer is out of toner again.",
    "Ancient Romans built aqueducts to carry water into their cities.",
    "The referee showed him a red card for a dangerous tackle.",
    "Scientists sequenced the genome of a rare deep-sea octopus.",
    "I can't find my keys anywhere; have you seen them?",
    "The price of wheat doubled after the drought in the plains.",
    "She painted the kitchen walls a pale shade of yellow.",
    "Quantum computers use qubits that can exist in superpositions.",
    "The train to Edinburgh departs from platform nine.",
    "Volunteers planted two thousand trees along the riverbank.",
]

# A different set: calibration for MiniLM (never evaluated on).
CALIBRATION_SENTENCES = [
    "The farmer repaired the fence before the storm arrived.",
    "Stock prices fell sharply after the earnings announcement.",
    "Proteins fold into shapes that determine their function.",
    "Let's meet at the station at half past seven.",
    "The goalkeeper saved a penalty in the last minute of the match.",
    "Snow closed the mountain pass for most of the winter.",
    "He practices piano for an hour every evening.",
    "The database query timed out because the table had no index.",
    "Passengers must show their boarding passes at the gate.",
    "Simmer the sauce until it thickens, then season to taste.",
    "The gallery acquired a painting by a little-known Dutch artist.",
    "Neutron stars are among the densest objects in the universe.",
    "She wrote a long letter to her friend overseas.",
    "Parliament debated the budget late into the night.",
    "A balanced diet includes plenty of fruit and vegetables.",
    "The swimming pool reopens after renovation next month.",
    "Antibiotics are ineffective against viral infections.",
    "The apple trees blossomed early this year.",
    "The company announced plans to open three new factories.",
    "Sea levels are rising as polar ice melts.",
    "Try clearing your browser cache and logging in again.",
    "The poem describes a journey through a winter forest.",
    "Light from the Sun takes about eight minutes to reach Earth.",
    "The jury reached a verdict after two days of deliberation.",
    "Whisk the eggs with sugar until pale and fluffy.",
    "The festival attracted visitors from over forty countries.",
    "Staff must complete safety training before using the equipment.",
    "Dolphins sleep with one half of their brain at a time.",
    "Workers resurfaced the motorway over the weekend.",
    "The hotel offers free breakfast and parking for guests.",
    "Wind turbines generated a record share of electricity last year.",
    "The choir sang carols in the town square.",
]

# SmolLM2 evaluation text: several unrelated paragraphs (well over 500 tokens).
EVAL_TEXT = [
    "The history of the bicycle is a story of gradual refinement. Early machines in the nineteenth century "
    "had no pedals at all: riders pushed themselves along with their feet. Later designs added pedals to the "
    "front wheel, which grew ever larger to increase speed, until the safety bicycle, with two wheels of equal "
    "size and a chain driving the rear wheel, made cycling practical for ordinary people.",
    "To make a simple tomato sauce, warm some olive oil in a heavy pan and soften a chopped onion over low heat. "
    "Add two cloves of garlic, a tin of chopped tomatoes and a pinch of salt. Let it simmer for twenty minutes, "
    "stirring now and then, and finish it with a handful of torn basil leaves just before serving.",
    "Economists often distinguish between short-term fluctuations and long-term growth. In the short run, output "
    "can rise or fall with changes in demand, interest rates and confidence. Over decades, however, living "
    "standards depend mostly on productivity: how much value a worker can produce in an hour, which in turn "
    "depends on skills, technology, infrastructure and institutions.",
    "Dear Maria, thank you for your letter and for the photographs from your trip. The mountains look wonderful, "
    "and I am glad the weather was kind to you. We have had a quiet month here. The garden is finally recovering "
    "from the dry summer, and the children have started at their new school, which they seem to enjoy.",
    "A computer program is a sequence of instructions that a machine can execute. High-level languages let "
    "programmers describe what they want in terms closer to human thought, and a compiler translates that "
    "description into the simpler operations the processor understands. Good compilers also optimize the code, "
    "removing redundant work and making better use of memory and registers.",
    "The coral reefs of the tropics are home to an astonishing variety of life. Although they cover less than one "
    "percent of the ocean floor, they support roughly a quarter of all marine species. Warmer water, pollution and "
    "overfishing threaten many reefs, and scientists are studying how some corals manage to survive heat waves.",
    "When the old lighthouse keeper retired, the village held a small party in the harbour inn. He told stories "
    "about storms that lasted for days, ships that nearly ran aground, and the winter when the lamp failed and he "
    "kept a lantern burning all night by hand. Everyone agreed that the light would never feel quite the same.",
    "Learning to play a musical instrument takes patience. At first, even simple scales feel awkward and slow. "
    "With regular practice, the fingers remember the movements, and attention can shift from the mechanics to "
    "the music itself: phrasing, dynamics and the feeling the composer wanted to express.",
    "The city plans to expand its tram network over the next ten years. New lines will connect the university, "
    "the hospital and the growing neighbourhoods in the east. Officials hope the project will reduce traffic, "
    "cut air pollution and make it easier for people without cars to reach jobs and services.",
    "Sleep plays an important role in memory. During deep sleep, the brain appears to replay the experiences of "
    "the day, strengthening some connections and weakening others. People who are deprived of sleep often find "
    "it harder to concentrate, make more mistakes and struggle to learn new skills.",
]

# SmolLM2 calibration text: different paragraphs on different topics.
CALIBRATION_TEXT = [
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface. Some erupt explosively, "
    "throwing ash high into the atmosphere, while others release slow rivers of lava that can flow for weeks. "
    "The soil around many volcanoes is unusually fertile, which is why people have farmed their slopes for "
    "thousands of years despite the danger.",
    "Before you start painting a room, move the furniture to the centre and cover it with old sheets. Fill any "
    "cracks in the walls, sand them smooth and wipe away the dust. Apply a coat of primer, wait for it to dry, "
    "and then paint from the top of the wall downwards using long, even strokes.",
    "The invention of the printing press changed how knowledge spread across Europe. Books that once took months "
    "to copy by hand could be produced in days, and their prices fell sharply. Literacy rose, new ideas travelled "
    "quickly between cities, and scholars could compare identical copies of the same text.",
    "Hi Tom, just a quick note to say the meeting has moved to Thursday afternoon. Could you bring the latest "
    "figures from the sales team and a few copies of the draft proposal? Let me know if the new time does not "
    "work for you and we can try to find another slot next week.",
    "A database stores information so that it can be retrieved and updated efficiently. Tables hold rows of "
    "records, indexes speed up searches, and transactions make sure that a group of changes either happens "
    "completely or not at all, even if the power fails in the middle of an update.",
    "Migrating birds travel thousands of kilometres each year between their breeding and wintering grounds. They "
    "navigate using the position of the sun, the patterns of the stars and even the Earth's magnetic field. Many "
    "species stop at the same wetlands every year to rest and feed before continuing their journey.",
    "The detective examined the room carefully. The window was locked from the inside, the desk drawers had been "
    "emptied onto the floor, and a half-finished cup of tea sat cold on the table. Whoever had been here had left "
    "in a hurry, but they had also known exactly what they were looking for.",
    "Running a small business means wearing many hats. The owner may handle sales in the morning, fix a broken "
    "machine at lunchtime and do the accounts late in the evening. Careful planning, loyal customers and a clear "
    "sense of what makes the business different are often the keys to surviving the first few years.",
    "Vaccination campaigns have eliminated smallpox and brought many other diseases close to eradication. "
    "Vaccines work by exposing the immune system to a harmless piece or version of a pathogen, so that the body "
    "can respond quickly and strongly if it ever meets the real infection.",
    "The football season ended with a dramatic final day. Three teams could still win the title, and the lead "
    "changed hands twice during the afternoon. In the end a late header decided the championship, and the "
    "supporters celebrated in the streets until long after midnight.",
]

# More SmolLM2 calibration text (with CALIBRATION_TEXT, about 3,000 tokens): GPTQ's Hessians
# for K up to 1,536 need several thousand tokens to be well conditioned. Topics, registers and
# forms vary (narrative, instructions, dialogue, lists, technical prose); none of it overlaps
# the evaluation text.
MORE_CALIBRATION_TEXT = [
    "The ancient city of Petra was carved directly into the rose-coloured cliffs of southern Jordan. Its builders, "
    "the Nabataeans, grew rich by controlling the trade routes that carried incense and spices across the desert. "
    "They built dams and cisterns to capture the rare winter rains, allowing thousands of people to live in a "
    "place where water was scarce for most of the year.",
    "Q: How often should I water a cactus? A: Less often than you might think. In spring and summer, water it "
    "thoroughly once the soil has dried out completely, which may take two or three weeks. In winter, when the "
    "plant is resting, once a month is usually enough. Too much water is the most common reason cacti die.",
    "The committee reviewed forty-two applications for the research grant this year. After two rounds of "
    "discussion, six projects were selected, covering topics from soil bacteria to the acoustics of concert "
    "halls. Each team will receive funding for three years and must present its progress at an annual workshop.",
    "My first job was in a bakery near the railway station. I started at four in the morning, shaping loaves "
    "and pulling trays of rolls from the ovens while the rest of the town slept. The work was hard and hot, but I "
    "loved the smell of fresh bread and the quiet conversations with the night-shift workers who came in for "
    "breakfast on their way home.",
    "Mathematics is sometimes described as the study of patterns. A prime number is a whole number greater than "
    "one that can be divided evenly only by one and itself. The Greeks proved more than two thousand years ago "
    "that there are infinitely many primes, yet questions about how they are distributed remain some of the "
    "deepest unsolved problems in the subject.",
    "Step one: unplug the lamp and let the old bulb cool down. Step two: unscrew the bulb gently, turning it "
    "anticlockwise. Step three: check the wattage printed on the lamp and choose a replacement that does not "
    "exceed it. Step four: screw in the new bulb until it is firm but not tight, then plug the lamp back in.",
    "The Amazon rainforest produces a large share of its own rainfall. Trees draw water from the soil and release "
    "it through their leaves, forming clouds that drift westward and fall as rain further inland. When large "
    "areas are cleared, this cycle weakens, and scientists worry that parts of the forest could turn into dry "
    "savanna.",
    "\"Are you sure this is the right road?\" asked Clara, peering at the map. \"Of course,\" said her brother, "
    "although he did not sound sure at all. The signposts had disappeared miles ago, the fuel gauge was dropping, "
    "and the only building they had passed in an hour was a barn with no roof.",
    "Good writing is usually clear before it is clever. Short sentences help the reader follow an argument, and "
    "concrete examples make abstract ideas easier to grasp. Most writers find that their first draft is too "
    "long: cutting unnecessary words is often the quickest way to improve a piece of text.",
    "The human heart beats about one hundred thousand times a day, pumping blood through a network of vessels "
    "that would stretch tens of thousands of kilometres if laid end to end. Oxygen-rich blood leaves the left side "
    "of the heart, travels to the organs and muscles, and returns to the right side to be sent to the lungs.",
    "Our hotel was a short walk from the old harbour, where fishing boats unloaded their catch every morning. We "
    "spent the days exploring narrow streets, eating grilled sardines and swimming in a small cove beyond the "
    "lighthouse. On the last evening a band played in the square and half the town came out to dance.",
    "Network engineers divide the work of sending data into layers. The lowest layers deal with cables, radio "
    "signals and the framing of bits, while higher layers handle addressing, routing and reliable delivery. "
    "Because each layer relies only on the one below it, a web browser does not need to know whether its "
    "packets travel over fibre, copper or wireless links.",
    "The recipe calls for three ripe bananas, two cups of flour, half a cup of sugar, one egg, a teaspoon of "
    "baking soda and a pinch of cinnamon. Mash the bananas, mix in the wet ingredients, fold in the dry ones and "
    "bake the batter in a greased tin for about an hour, until a skewer comes out clean.",
    "In 1969 two astronauts walked on the surface of the Moon while a third orbited above them. They collected "
    "rocks, set up experiments and planted a flag before returning to their lunar module. The mission was watched "
    "on television by hundreds of millions of people, and it remains one of the most famous events of the "
    "twentieth century.",
    "Dear customer, we are sorry to hear that your order arrived damaged. Please reply to this message with a "
    "photograph of the item and its packaging, and we will send a replacement free of charge. You do not need to "
    "return the damaged goods. We apologise for the inconvenience and thank you for your patience.",
    "Philosophers have long argued about whether we can know anything with certainty. Some claim that all "
    "knowledge begins with experience, while others insist that certain truths, such as those of logic and "
    "arithmetic, can be known by reason alone. The debate shaped much of modern science and still influences how "
    "we think about evidence.",
    "The town's annual flower show opened on Saturday with more than three hundred entries. Prizes were awarded "
    "for the best roses, the tallest sunflower and the most imaginative hanging basket. The overall winner, a "
    "retired teacher, said she had been growing dahlias in her back garden for almost fifty years.",
    "Electric current is the flow of charge through a conductor. Voltage measures the push that drives the "
    "current, and resistance measures how strongly a material opposes it. Ohm's law ties the three together: the "
    "current through a resistor equals the voltage across it divided by its resistance.",
    "Wolves live in family groups called packs, usually a breeding pair and their offspring from the last few "
    "years. They hunt together, share food and raise their pups cooperatively. After wolves were returned to "
    "Yellowstone, researchers noticed changes throughout the park, from the behaviour of elk to the growth of "
    "trees along the rivers.",
    "Meeting notes, Monday: the design team will finish the new homepage by the end of the month. Marketing needs "
    "the final images two weeks before launch. Testing revealed slow loading on older phones, so the developers "
    "will compress the pictures and delay loading the video until the visitor scrolls down.",
    "The violinist closed her eyes as the orchestra fell silent. For a moment the hall was completely still; then "
    "she began the slow opening melody, so quietly that the audience leaned forward to hear it. By the final "
    "movement many listeners were in tears, and the applause lasted for several minutes.",
    "Recycling works best when materials are kept clean and separated. Paper soaked in food waste is often "
    "rejected, and a single broken glass jar can contaminate a whole load of cardboard. Many cities now ask "
    "residents to rinse containers and to check which plastics are accepted before putting them in the bin.",
    "A good night's sleep begins long before bedtime, according to many doctors. They recommend going to bed at "
    "the same time every night, avoiding heavy meals and caffeine in the evening, and keeping the bedroom cool, "
    "dark and quiet. Screens should be switched off at least half an hour before sleep.",
    "The treaty was signed after months of difficult negotiations. Both sides agreed to reduce their armies, open "
    "the border to trade and release prisoners held since the war. Not everyone welcomed the agreement, but most "
    "historians now see it as the beginning of a long period of peace in the region.",
    "Children learn their first language without formal lessons, simply by listening and trying to speak. By the "
    "age of five, most can use thousands of words and follow complex grammatical rules that they could never "
    "explain. Linguists still debate how much of this ability is built in and how much comes from experience.",
    "To reset your password, open the settings page and choose the security tab. Enter your current password, "
    "then type the new one twice. A strong password is at least twelve characters long and mixes letters, numbers "
    "and symbols. If you have forgotten your current password, use the link on the login page instead.",
]
